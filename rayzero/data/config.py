from rayzero._frozen import Frozen


class DataConfig(Frozen):
    path: str = ""  # a prepared dataset (local path or URI); empty = the stdlib corpus
    cache_dir: str = "~/.cache/rayzero/datasets"  # where the default corpus is prepared once
