from rayzero.data.batches import RankBatches, global_batch_offsets
from rayzero.data.config import DataConfig
from rayzero.data.tokens import DataError, TokenDataset, prepare, read_meta

__all__ = ["DataConfig", "DataError", "RankBatches", "TokenDataset", "global_batch_offsets", "prepare", "read_meta"]
