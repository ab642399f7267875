"""One tokenizer everywhere: what `AutoTokenizer.from_pretrained(MODEL_DIR)` gives is what
`data prepare --tokenizer MODEL_DIR` encodes with, what training's check compares against,
what `generate` and an export's users tokenize with; and chat-aware generation."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from rayzero.config import ConfigError, load_config
from rayzero.data.tokens import DataError, TokenDataset, dataset_tokenizer, dataset_tokenizer_files
from rayzero.jobs.train import check_data_tokenizer
from tests.conftest import cli_in_process
from tests.models import save_chat_model, save_hf_model, save_tokenizer

TEXT = Path(sys.modules["json"].__file__).read_text()
# Digits (Qwen2's tokenizer splits them one by one), a special token's text, code.
DOCS = ["x = 12345 + 678\n<|endoftext|> def f(): return 'abc'\n" * 3, TEXT[:2000]]
SPECIAL = {"cohere": ("<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>")}


def model_with_tokenizer(tmp_path, arch: str) -> Path:
    model = save_hf_model(arch, tmp_path / arch)
    save_tokenizer(model, [TEXT], vocab=300, special=SPECIAL.get(arch, ("<s>", "</s>")))
    return model


def prepare(tmp_path, capsys, monkeypatch, tokenizer: Path, name: str) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "data", "prepare", str(src), str(tmp_path / name),
                                  "--tokenizer", str(tokenizer), "--no-progress")
    assert code == 0, err
    return tmp_path / name


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "cohere"])
def test_prepare_check_export_and_generate_tokenize_as_autotokenizer(tmp_path, capsys, monkeypatch, arch):
    import transformers as tf

    from rayzero.checkpoint.export import save_final
    from rayzero.jobs.generate import load_generator
    from rayzero.workers.assembly import make_spec

    model = model_with_tokenizer(tmp_path, arch)
    users = tf.AutoTokenizer.from_pretrained(str(model))  # what the user's own code loads
    data = prepare(tmp_path, capsys, monkeypatch, model, "data")
    ds = TokenDataset(str(data))
    record = ds.meta["tokenizer"]
    assert record["class"] == type(users).__name__
    first = ds.window(0, ds.document_lengths[0]).tolist()
    ids = users(DOCS[0], add_special_tokens=False)["input_ids"]
    bos = [] if record["bos_id"] is None else [record["bos_id"]]
    assert first == bos + ids + [record["eos_id"]]  # [BOS] + the text's ids + the separator

    cfg = load_config(None, ["model.kind=hf", f"model.path={model}"])
    check_data_tokenizer(cfg, ds.meta, str(data))  # training takes it
    assert dataset_tokenizer(str(data)).sha256 == record["sha256"]  # the copy the dataset keeps is the same

    # The bare tokenizer.json in a folder of its own: transformers gives the generic class there.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    other = prepare(tmp_path, capsys, monkeypatch, bare, "bare-data")
    if type(tf.AutoTokenizer.from_pretrained(str(bare))) is not type(users):  # Qwen2, GPT-2, Cohere
        with pytest.raises(DataError, match=rf"prepare it with `rayzero data prepare SRC OUT --tokenizer {model}`"):
            check_data_tokenizer(cfg, TokenDataset(str(other)).meta, str(other))

    # The export (the final weights as the controller writes them) and what loads it.
    weights = tf.AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
    out = tmp_path / "export"
    save_final(make_spec(cfg), weights, str(out), "hf", {}, tokenizer=lambda: dataset_tokenizer_files(str(data)))
    exported = tf.AutoTokenizer.from_pretrained(str(out))
    assert type(exported) is type(users)
    for doc in DOCS:
        assert exported(doc)["input_ids"] == users(doc)["input_ids"]
        assert load_generator(str(out)).tokenizer.encode_batch([doc])[0].tolist() == users(doc, add_special_tokens=False)["input_ids"]


def test_a_model_without_a_tokenizer_exports_the_one_its_data_was_made_with(tmp_path, capsys, monkeypatch):
    import transformers as tf

    from rayzero.checkpoint.export import save_final
    from rayzero.jobs.generate import find_tokenizer
    from rayzero.workers.assembly import make_spec

    model = save_hf_model("qwen2", tmp_path / "bare-model")  # config and weights, no tokenizer
    tok = tmp_path / "tok"
    tok.mkdir()
    save_tokenizer(tok, [TEXT], vocab=300)
    (tok / "config.json").write_bytes((model / "config.json").read_bytes())  # a Qwen2 tokenizer, as a hub copy has
    data = prepare(tmp_path, capsys, monkeypatch, tok, "data")
    cfg = load_config(None, ["model.kind=hf", f"model.path={model}"])
    check_data_tokenizer(cfg, TokenDataset(str(data)).meta, str(data))  # the model has none to compare with
    out = tmp_path / "export"
    save_final(make_spec(cfg), tf.AutoModelForCausalLM.from_pretrained(str(model)).state_dict(), str(out), "hf", {},
               tokenizer=lambda: dataset_tokenizer_files(str(data)))
    users = tf.AutoTokenizer.from_pretrained(str(tok))
    assert type(users).__name__ == "Qwen2Tokenizer"
    assert tf.AutoTokenizer.from_pretrained(str(out))(DOCS[0])["input_ids"] == users(DOCS[0])["input_ids"]
    # generate from a checkpoint of it finds the dataset's copy
    assert find_tokenizer(str(model), str(data)).sha256 == TokenDataset(str(data)).meta["tokenizer"]["sha256"]


def test_generation_needs_the_tokenizer_it_was_trained_with(tmp_path):
    from rayzero.data.tokens import prepare as prepare_data
    from rayzero.jobs.generate import find_tokenizer

    tok = tmp_path / "tok"
    tok.mkdir()
    save_tokenizer(tok, [TEXT], vocab=300)
    (tmp_path / "a.txt").write_text(TEXT)
    prepare_data(tmp_path / "a.txt", str(tmp_path / "data"), tokenizer=str(tok))
    for f in (tmp_path / "data" / "tokenizer").iterdir():  # as a dataset prepared before it kept one
        f.unlink()
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    del meta["tokenizer"]["dir"]
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="give --tokenizer"):
        find_tokenizer(None, str(tmp_path / "data"))
    assert find_tokenizer(None, None).kind == "byte"


# --------------------------------------------------------------------------- chat-aware generation

class Scripted(nn.Module):
    """Says `script` after any prompt, one token per call, whatever the weights."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.script, self.vocab, self.start = script, vocab, None

    def forward(self, x):
        if self.start is None:
            self.start = x.shape[1]
        i = min(x.shape[1] - self.start, len(self.script) - 1)
        logits = torch.zeros(1, x.shape[1], self.vocab)
        logits[0, -1, self.script[i]] = 1.0
        return logits


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from rayzero.models.hf import model_tokenizer

    model = save_chat_model(tmp_path_factory.mktemp("chat") / "qwen2-chat", [TEXT])
    return model, model_tokenizer(str(model))


def test_a_chat_is_rendered_with_the_template_and_the_answer_ends_at_end_of_turn(chat_tokenizer):
    from rayzero.jobs.generate import Generator, _eos_ids, _model_files

    model_dir, tok = chat_tokenizer
    im_end, eot = tok.tok.convert_tokens_to_ids("<|im_end|>"), tok.tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.end_of_turn_ids() == {im_end}
    answer = tok.encode_batch(["Paris"])[0].tolist()
    junk = tok.encode_batch([" and then more"])[0].tolist()

    def generator(script):
        return Generator(Scripted(script, 384), tok, eos_ids=_eos_ids(_model_files(str(model_dir))))

    gen = generator(answer + [im_end] + junk)
    assert gen.stop_ids == {im_end, eot}  # the tokenizer's EOS and the generation config's
    assert gen("What is the capital of France?", max_new_tokens=30) == "Paris"
    ids, chatting = gen.encode("Hi", None, "Be brief.", None)
    assert chatting and tok.decode(ids) == tok.tok.decode(ids, skip_special_tokens=True)
    assert tok.tok.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                                  "<|im_start|>assistant\n"
    # raw text: the prompt as it is, no template
    ids, chatting = gen.encode("Hi", None, None, False)
    assert not chatting and ids == tok.encode_batch(["Hi"])[0].tolist()
    # a whole conversation
    said = generator(answer + [eot])(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                                {"role": "user", "content": "c"}], max_new_tokens=30)
    assert said == "Paris"
    with pytest.raises(ConfigError, match="leave out raw"):
        gen("Hi", system="x", chat=False)


def test_without_a_template_chat_is_refused_and_raw_continues(tmp_path):
    from rayzero.data.tokenizer import load_tokenizer
    from rayzero.jobs.generate import Generator

    save_tokenizer(tmp_path, [TEXT], vocab=300)
    tok = load_tokenizer(str(tmp_path))
    assert tok.end_of_turn_ids() == set()
    gen = Generator(Scripted([5, 6, tok.eos_id, 7], 320), tok)
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        gen("Hi", chat=True)
    assert gen("Hi", max_new_tokens=10) == tok.decode([5, 6])  # auto: raw, up to the end of sequence


def test_generate_on_the_command_line_answers_a_chat(tmp_path, capsys, monkeypatch, chat_tokenizer):
    """`rayzero generate` on an HF directory with a chat template: the answer alone, cut at the
    end-of-turn token; `--raw` prints the prompt and its continuation; --chat and --raw exclude
    each other."""
    from rayzero.jobs.generate import load_generator

    model_dir, _ = chat_tokenizer
    gen = load_generator(str(model_dir))
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(model_dir), "--prompt", "Hi",
                                    "--system", "Be brief.", "--max-new-tokens", "12")
    assert code == 0, err
    assert out == gen("Hi", 12, system="Be brief.") + "\n"
    code, out, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(model_dir), "--prompt", "Hi",
                                    "--max-new-tokens", "12", "--raw")
    assert code == 0 and out == "Hi" + gen("Hi", 12, chat=False) + "\n", err
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(model_dir), "--prompt", "Hi",
                                  "--chat", "--raw")
    assert code == 2 and "not allowed with argument" in err


def test_generate_chat_without_a_template_is_one_clear_message(tmp_path, capsys, monkeypatch):
    model = model_with_tokenizer(tmp_path, "llama")
    code, _, err = cli_in_process(capsys, monkeypatch, tmp_path, "generate", str(model), "--prompt", "Hi", "--chat")
    assert code == 2 and err.startswith("rayzero: error: the tokenizer has no chat template: give the prompt as plain "
                                        "text (--raw)") and len(err.splitlines()) == 1
