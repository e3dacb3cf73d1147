"""Your data: text folders, prepared tokens, image folders, py: factories and Python datasets; local tokenizers."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from scaletrain.cli import main
from scaletrain.data.loader import build_loader
from scaletrain.data.prepare import prepare
from scaletrain.data.sources import user_datasets
from scaletrain.errors import UserError
from scaletrain.train.config import load_config
from scaletrain.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
BASE = ["train.steps=4", "train.global_batch=4", "data.seq_len=16", "train.eval_batches=1", "train.progress=off",
        "train.log_every=1", "train.eval_every=0", "model.overrides.n_layer=1"]
LINES = [f"the quick brown fox {i} jumps over the lazy dog, {i * 7} times" for i in range(120)]


def make_tokenizer(d: Path, byte_level: bool = False) -> Path:
    """A BPE tokenizer trained on a few lines here (nothing downloaded), saved as d/tokenizer.json;
    ``byte_level``: GPT-2's pre-tokenizer (keeps whitespace runs as tokens), else whitespace splitting."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    pre = tokenizers.pre_tokenizers
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False) if byte_level else pre.Whitespace()
    texts = ["\n\n  \n".join(LINES), "\n".join(LINES)] if byte_level else LINES  # learns whitespace-run merges
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"]))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Three .txt files and one .jsonl file of the lines above."""
    d = tmp_path / "text"
    d.mkdir()
    for k in range(3):
        (d / f"part{k}.txt").write_text("\n".join(LINES[k::4]))
    (d / "more.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(LINES[3::4])))
    return d


def cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def fit(args: list[str], out: Path | None = None, resume: bool = False, **kw):
    tr = Trainer(load_config(None, BASE + args), out, resume=resume, log=lambda s: None, **kw)
    try:
        return tr, tr.fit()
    finally:
        tr.close()


def test_text_folder_tokenizer_sizes_the_model_and_prepared_tokens_equal_text(tmp_path, corpus):
    """A local tokenizer's vocabulary reaches the model; the prepared memory map gives the very
    windows (and losses) the in-memory text path gives; jsonl documents are read by data.field."""
    tok = make_tokenizer(tmp_path / "tok")
    meta = prepare(str(corpus), tmp_path / "prep", str(tok))
    assert meta["documents"] == 3 + 30 and meta["dtype"] == "uint16" and meta["vocab_size"] < 300
    text_train, text_val = user_datasets(f"text:{corpus}", seq_len=16, tokenizer=str(tok))
    prep_train, prep_val = user_datasets(f"tokens:{tmp_path / 'prep'}", seq_len=16)
    assert isinstance(prep_train.tokens, np.memmap)
    assert len(text_train) == len(prep_train) > 0 and len(text_val) == len(prep_val) > 0
    for i in (0, len(text_train) - 1):
        assert all(torch.equal(a, b) for a, b in zip(text_train[i], prep_train[i]))
    a, ra = fit([f"data.name=text:{corpus}", f"data.tokenizer={tok}"])
    b, rb = fit([f"data.name=text:{tmp_path / 'prep'}"])  # text: on a prepared directory reads its tokens
    assert ra.losses == rb.losses and ra.val_loss == rb.val_loss
    assert a.model.embed.wte.weight.shape[0] == meta["vocab_size"] == b.model.embed.wte.weight.shape[0]


def test_text_resumes_exactly(tmp_path, corpus):
    """4 steps straight = 2 steps, then --resume for 2 (same losses bit for bit)."""
    args = [f"data.name=text:{corpus}", "train.checkpoint_every=2"]
    whole = fit(args, tmp_path / "a")[1].losses
    fit(args[:1] + ["train.steps=2"], tmp_path / "b")
    rest = fit(args[:1], tmp_path / "b", resume=True)[1].losses
    assert len(whole) == 4 and rest == whole[2:]


def test_bad_data_is_one_line_exit_2_nothing_written(tmp_path, corpus):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "rows.jsonl").write_text('{"body": "x"}\n')
    tok = make_tokenizer(tmp_path / "tok")
    cases = {f"data.name=text:{tmp_path / 'nope'}": "no such file",
             f"data.name=text:{tmp_path / 'empty.txt'}": "no text",
             f"data.name=text:{tmp_path / 'latin1.txt'}": "not UTF-8",
             f"data.name=text:{tmp_path / 'rows.jsonl'}": "no string field 'text'",
             f"data.name=tokens:{corpus}": "scaletrain data prepare",
             f"data.name=images:{corpus}": "no class sub-directories",
             "data.name=py:no_such_module_x:f": "cannot import",
             f"data.name=shakespeare data.tokenizer={tok}": "has its own tokens",
             f"model.overrides.vocab_size=100 data.tokenizer={tok} data.name=text:{corpus}":
                 "model.overrides.vocab_size >= "}
    out = tmp_path / "run"
    for arg, words in cases.items():
        code, err = cli("train", *arg.split(), *BASE, "--out", str(out))
        assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, (arg, err)
        assert not out.exists()
    code, err = cli("data", "prepare", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "p"))
    assert code == 2 and "not UTF-8" in err and not (tmp_path / "p").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_image_folder_trains_with_its_class_count(tmp_path):
    """An ImageFolder tree of PNGs: per-class split, the class count reaches the model, decoded sizes."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog", "eel"):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(tmp_path / "img" / c / f"{i}.png")
    train, val = user_datasets(f"images:{tmp_path / 'img'}", seq_len=1, val_fraction=0.2, image_size=16)
    assert (len(train), len(val)) == (15, 3) and train.num_classes == 3
    assert {p for p, _ in train.samples}.isdisjoint(p for p, _ in val.samples)
    x, y = train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and -1 <= x.min() <= x.max() <= 1 and y.item() == 0
    tr, res = fit([f"data.name=images:{tmp_path / 'img'}", "model.name=resnet-mini", "data.image_size=16",
                   "model.overrides={}", "data.val_fraction=0.2", "train.steps=2", "train.global_batch=3"])
    assert tr.model.head.fc.out_features == 3 and len(res.losses) == 2 and 0 <= res.val_metrics["val_acc"] <= 1


class Stream(IterableDataset):
    """0, 1, ..., n-1 as (x, y) pairs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([i]), torch.tensor(i)


def test_iterable_shards_disjointly_and_resumes_by_position():
    def firsts(rank: int, start: int, k: int) -> list[int]:
        it = iter(build_loader(Stream(11), 2, shuffle=True, seed=0, rank=rank, world_size=2, start_sample=start,
                               infinite=True))
        return [int(v) for _ in range(k) for v in next(it)[1]]

    r0, r1 = firsts(0, 0, 4), firsts(1, 0, 4)
    # 11 items: a pass is 5 whole pairs (item 10 dropped so both ranks get as many), then a new pass
    assert r0 == [0, 2, 4, 6, 8, 0, 2, 4] and r1 == [1, 3, 5, 7, 9, 1, 3, 5]
    assert firsts(0, 4, 2) == r0[2:6] and firsts(1, 4, 2) == r1[2:6]  # resume after one step of 2 x 2


class Pairs(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return {"ids": torch.randint(0, 256, (17,), generator=g)}


def collate(rows):
    ids = torch.stack([r["ids"] for r in rows])
    return ids[:, :-1], ids[:, 1:]


def test_python_datasets_lists_and_collate(tmp_path):
    """Trainer(train_data=...) with a Dataset + collate_fn, a list of texts, and an IterableDataset."""
    from scaletrain.models import get

    m = get("gpt2-tiny", n_layer=1)
    _, a = fit([], train_data=Pairs(), collate_fn=collate, model=m)
    assert len(a.losses) == 4 and np.isfinite(a.val_loss)
    _, b = fit([], train_data=LINES, eval_data=LINES[:20], model=get("gpt2-tiny", n_layer=1))
    assert len(b.losses) == 4
    _, c = fit([], train_data=Stream(100), collate_fn=lambda rows: (
        torch.stack([torch.arange(16) + r[0] for r in rows]) % 256,
        torch.stack([torch.arange(1, 17) + r[0] for r in rows]) % 256), model=get("gpt2-tiny", n_layer=1))
    assert len(c.losses) == 4
    images = [(torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(i)), torch.tensor(i % 10))
              for i in range(40)]

    class ImageStream(IterableDataset):  # a classifier on a stream: no length, no image-size preflight by index
        def __iter__(self):
            return iter(images)

    _, d = fit(["model.name=mlp", "model.overrides={}"], train_data=ImageStream())
    assert len(d.losses) == 4 and 0 <= d.val_metrics["val_acc"] <= 1


def test_py_factory_with_split(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n"
        "def make(split):\n    g = torch.Generator().manual_seed(0 if split == 'train' else 1)\n"
        "    x = torch.randint(0, 256, (32, 17), generator=g)\n    return TensorDataset(x[:, :-1], x[:, 1:])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    tr, res = fit(["data.name=py:mydata:make"])
    assert len(tr.train_set) == 32 and len(res.losses) == 4
    sys.modules.pop("mydata", None)


def test_hf_disk_dataset_dict_split_by_key(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": LINES[:100]}),
                               "validation": datasets.Dataset.from_dict({"body": LINES[100:]})})
    dd.save_to_disk(str(tmp_path / "hf"))
    train, val = user_datasets(f"hf-disk:{tmp_path / 'hf'}", seq_len=16, field="body")
    joined = "".join(LINES[:100]).encode()
    assert bytes(train.tokens[:50].tolist()) == joined[:50] and len(val.tokens) == len("".join(LINES[100:]).encode())
    _, res = fit([f"data.name=hf-disk:{tmp_path / 'hf'}", "data.field=body", "train.steps=2"])
    assert len(res.losses) == 2


def test_large_txt_files_stream_in_pieces(tmp_path, corpus, monkeypatch):
    """A .txt file read in pieces cut after newlines gives the same tokens as read whole, one
    end-of-document token per file, and a bad byte's offset counted from the file's start."""
    from scaletrain.data import documents

    tok = make_tokenizer(tmp_path / "tok", byte_level=True)
    for f in corpus.glob("*.txt"):  # runs of blank lines and spaces, which a careless cut would tokenize apart
        f.write_text(f.read_text().replace("\n", "\n\n  \n", 5))
    whole = prepare(str(corpus), tmp_path / "a", str(tok))
    monkeypatch.setattr(documents, "PIECE_BYTES", 100)
    pieces = prepare(str(corpus), tmp_path / "b", str(tok))
    assert (tmp_path / "a" / "tokens.bin").read_bytes() == (tmp_path / "b" / "tokens.bin").read_bytes()
    assert whole["documents"] == pieces["documents"] == 33
    eos = np.fromfile(tmp_path / "a" / "tokens.bin", dtype=np.uint16) == whole["eos_id"]
    assert eos.sum() == 33
    (tmp_path / "late.txt").write_bytes(b"ok line\n" * 40 + b"\xff")
    with pytest.raises(UserError, match="byte 320"):
        prepare(str(tmp_path / "late.txt"), tmp_path / "c")


def test_export_hf_writes_the_tokenizer_beside_the_model(tmp_path, corpus):
    """The injected vocabulary is recorded in config.toml, so export rebuilds the trained shape; the
    run's tokenizer lands beside the model, and transformers loads both."""
    transformers = pytest.importorskip("transformers")
    tok = make_tokenizer(tmp_path / "tok")
    llama = ["model.name=hf:llama", "model.overrides={num_hidden_layers=1, hidden_size=32, intermediate_size=64}",
             f"data.name=text:{corpus}", f"data.tokenizer={tok}", "train.steps=2"]
    fit(llama, tmp_path / "run")
    import tomllib

    recorded = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert recorded["data"]["tokenizer"] == str(tok)
    code, err = cli("checkpoint", "export", str(tmp_path / "run"), "--to", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    assert model.config.vocab_size == len(fast) == recorded["model"]["overrides"]["vocab_size"]
    assert model(torch.tensor([fast.encode("the lazy dog")])).logits.shape[-1] == len(fast)
