"""Shipped data, tokenizer, synthetic sets, registry and resumable distributed loaders."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler

import scaletrain.data as data
from scaletrain.data import (
    DATASETS,
    ByteTokenizer,
    DigitsDataset,
    SyntheticImages,
    SyntheticTokens,
    TextDataset,
    build_loader,
    byte_unigram_entropy,
    get_dataset,
    load_digits,
    load_text,
)
from scaletrain.data.images import train_pixel_stats
from scaletrain.data.loader import ResumableDistributedSampler
from scaletrain.data.text import split_point
from scaletrain.errors import UserError

CORPORA = Path(data.__file__).with_name("corpora")


# -- shipped files ----------------------------------------------------------------------------
def test_shipped_corpora_fit_in_5_mb_and_carry_their_source_notes():
    files = [p for p in CORPORA.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 5_000_000
    for sub in ("shakespeare", "digits"):
        note = (CORPORA / sub / "SOURCE.md").read_text()
        assert "Licence" in note and "Origin" in note
    assert "public domain" in (CORPORA / "shakespeare" / "SOURCE.md").read_text()
    assert "CC BY 4.0" in (CORPORA / "digits" / "SOURCE.md").read_text()


def test_text_is_fixed_and_split_is_disjoint_and_contiguous():
    train, val = load_text("train"), load_text("val")
    whole = np.concatenate([train, val])
    # The corpus is pinned: a changed file or split rule fails here.
    assert len(whole) == 5_057_323
    assert split_point() == len(train) == 4_551_625
    assert 0.09 < len(val) / len(whole) < 0.11
    assert train[-1] == ord("\n")  # validation starts on a fresh line
    assert train.dtype == val.dtype == np.uint8
    # Same bytes twice (no state, no shuffling).
    assert np.array_equal(load_text("val"), val)
    # No leakage: passages from the validation text do not occur in the training text.
    train_bytes = train.tobytes()
    for start in (1_000, 200_000, 400_000):
        assert val[start : start + 300].tobytes() not in train_bytes
    assert whole.tobytes().isascii()
    with pytest.raises(UserError, match="allowed: train, val"):
        load_text("test")


def test_corpus_content_is_pinned():
    whole = np.concatenate([load_text("train"), load_text("val")]).tobytes()
    assert hashlib.sha256(whole).hexdigest() == PINNED_CORPUS_SHA256


# sha256 of the decompressed corpus (train + val) as built by scaletrain.data._build_corpora.
PINNED_CORPUS_SHA256 = "e1d2e18ac43deb31b3e5d9717ab4783be810a9c5cd0e7cb2c83797d39757bac8"


def test_byte_unigram_entropy_is_plausible_for_english_and_matches_torch():
    for split in ("train", "val"):
        h = byte_unigram_entropy(split)
        # English text with capitals, punctuation and newlines: ~4.8 bits = ~3.3 nats per byte;
        # far below ln(256) = 5.55 (uniform bytes) and above 2.8 (lower-case letters only).
        assert 3.1 < h < 3.5, (split, h)
        counts = torch.bincount(torch.from_numpy(load_text(split).astype(np.int64)), minlength=256)
        ref = torch.distributions.Categorical(probs=counts.double() / counts.sum()).entropy()
        assert h == pytest.approx(ref.item(), rel=1e-12)


# -- tokenizer --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    ["", "To be, or not to be", "naïve café — «déjà vu»", "東京 🎭 Ωμέγα\n\t\x00"],
)
def test_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size == 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.int64)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trips_any_unicode_string(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_rejects_bad_ids_and_reports_cut_characters():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="outside"):
        tok.decode([65, 256])
    cut = tok.encode("é")[:1]  # first byte of a two-byte character
    with pytest.raises(UnicodeDecodeError):
        tok.decode(cut)
    assert tok.decode(cut, errors="replace") == "\ufffd"


def test_tokenizer_decodes_shipped_windows_back_to_the_text():
    ds = TextDataset("val", 64)
    x, _ = ds[10]
    assert ByteTokenizer().decode(x) == load_text("val")[640:704].tobytes().decode()


# -- text dataset -----------------------------------------------------------------------------
def test_text_dataset_windows_shapes_and_shift():
    ds = TextDataset("train", 128)
    n = len(load_text("train"))
    assert len(ds) == (n - 129) // 128 + 1
    for i in (0, 1, len(ds) - 1, -1):
        x, y = ds[i]
        assert x.shape == y.shape == (128,)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[1:], y[:-1])
    i = 7
    raw = torch.from_numpy(load_text("train")[i * 128 : i * 128 + 129].astype(np.int64))
    assert torch.equal(ds[i][0], raw[:-1]) and torch.equal(ds[i][1], raw[1:])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_text_dataset_stride_gives_overlapping_windows():
    ds = TextDataset("val", 100, stride=10)
    assert len(ds) == (len(load_text("val")) - 101) // 10 + 1
    assert torch.equal(ds[0][0][10:], ds[1][0][:90])
    with pytest.raises(UserError):
        TextDataset("val", 0)
    with pytest.raises(UserError, match="longer than"):
        TextDataset("val", 10_000_000)


# -- digits -----------------------------------------------------------------------------------
def test_digits_are_the_1797_uci_images_with_all_labels():
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert images.min() == 0 and images.max() == 16
    assert set(labels.tolist()) == set(range(10))
    train, val = DigitsDataset("train"), DigitsDataset("val")
    assert (len(train), len(val)) == (1437, 360)
    assert set(train.labels.tolist()) == set(val.labels.tolist()) == set(range(10))


def test_digits_samples_shape_dtype_and_normalisation():
    ds = DigitsDataset("train", image_size=32, channels=3)
    x, y = ds[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.shape == () and 0 <= int(y) <= 9
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])
    # At the native size the transform is exactly (pixel / 16 - mean) / std of the train pixels.
    native = DigitsDataset("train", image_size=8, channels=1)
    mean, std = train_pixel_stats()
    images, labels = load_digits()
    expected = (torch.from_numpy(images[5].astype(np.float32)) / 16 - mean) / std
    assert torch.allclose(native[5][0][0], expected, atol=1e-6)
    assert int(native[5][1]) == int(labels[5])
    stacked = torch.stack([native[i][0] for i in range(len(native))])
    assert abs(stacked.mean().item()) < 1e-4 and stacked.std().item() == pytest.approx(1, abs=1e-3)
    # Bilinear upsampling keeps values within the range of the 8x8 image.
    assert x.min() >= expected.min() - 1e-5 and x.max() <= expected.max() + 1e-5


# -- synthetic --------------------------------------------------------------------------------
def test_synthetic_tokens_are_fixed_per_index_whatever_the_order():
    a = SyntheticTokens(1000, 16, 50, seed=3)
    forward = [a[i] for i in range(50)]
    b = SyntheticTokens(1000, 16, 50, seed=3)
    backward = {i: b[i] for i in reversed(range(50))}
    for i in range(50):
        assert torch.equal(forward[i][0], backward[i][0])
        assert torch.equal(forward[i][1], backward[i][1])
        x, y = forward[i]
        assert x.dtype == torch.int64 and x.shape == (16,) and torch.equal(x[1:], y[:-1])
        assert 0 <= x.min() and x.max() < 1000
    assert not torch.equal(a[0][0], a[1][0])
    assert not torch.equal(a[0][0], SyntheticTokens(1000, 16, 50, seed=4)[0][0])
    assert not torch.equal(a[0][0], SyntheticTokens(1000, 16, 50, seed=3, stream=1)[0][0])


def test_synthetic_images_are_fixed_per_index():
    ds = SyntheticImages(3, 12, 7, 40, seed=1)
    x, y = ds[9]
    assert x.shape == (3, 12, 12) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(SyntheticImages(3, 12, 7, 40, seed=1)[9][0], x)
    assert not torch.equal(ds[8][0], x)
    big = SyntheticImages(3, 64, 10, 2, seed=0)[0][0]  # 12,288 draws of N(0, 1)
    assert abs(big.mean().item()) < 0.05 and big.std().item() == pytest.approx(1, abs=0.05)
    labels = {int(ds[i][1]) for i in range(40)}
    assert labels <= set(range(7)) and len(labels) > 1
    with pytest.raises(IndexError):
        ds[40]


# -- registry ---------------------------------------------------------------------------------
def test_registry_builds_every_name_with_its_kind():
    assert set(DATASETS) == {"shakespeare", "digits", "synthetic-text", "synthetic-images"}
    for name, info in DATASETS.items():
        ds = get_dataset(name, "val", seq_len=32, image_size=16, num_samples=20)
        assert len(ds) == 20 and ds.kind == info.kind
        x, y = ds[0]
        if info.kind == "text":
            assert x.shape == y.shape == (32,) and x.dtype == torch.int64
        else:
            assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
            assert ds.num_classes == 10


def test_registry_rejects_bad_names_and_values_with_one_line():
    with pytest.raises(UserError) as err:
        get_dataset("imagenet", "train")
    msg = str(err.value)
    assert "imagenet" in msg and "\n" not in msg
    assert all(name in msg for name in DATASETS)
    with pytest.raises(UserError, match="allowed: train, val"):
        get_dataset("digits", "validation")
    with pytest.raises(UserError, match="vocab_size"):
        get_dataset("shakespeare", "train", vocab_size=100)
    assert get_dataset("shakespeare", "train", vocab_size=50257, seq_len=8).vocab_size == 256


def test_registry_synthetic_train_and_val_differ_and_follow_seed():
    tr = get_dataset("synthetic-text", "train", seq_len=8, vocab_size=50, seed=5)
    va = get_dataset("synthetic-text", "val", seq_len=8, vocab_size=50, seed=5)
    assert not torch.equal(tr[0][0], va[0][0])
    again = get_dataset("synthetic-text", "train", seq_len=8, vocab_size=50, seed=5)
    assert torch.equal(tr[0][0], again[0][0])


# -- loaders ----------------------------------------------------------------------------------
class Indices(Dataset):
    """Sample i is the tensor [i], so batches show which samples were drawn."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _batches(loader, count: int) -> list[list[int]]:
    return [b.flatten().tolist() for b in itertools.islice(iter(loader), count)]


@pytest.mark.parametrize("world_size,drop_last", [(1, True), (2, True), (3, False), (2, False)])
def test_sampler_order_matches_torch_distributed_sampler(world_size, drop_last):
    ds, b = Indices(23), 4
    for rank in range(world_size):
        ours = ResumableDistributedSampler(
            ds, b, shuffle=True, seed=11, rank=rank, world_size=world_size, drop_last=drop_last
        )
        ref = DistributedSampler(
            ds, num_replicas=world_size, rank=rank, shuffle=True, seed=11, drop_last=drop_last
        )
        for epoch in range(3):
            ref.set_epoch(epoch)
            assert ours.epoch_indices(epoch) == list(ref)[: ours.used_per_rank]
        assert ours.epoch_indices(0) != ours.epoch_indices(1)  # reshuffled per epoch


@pytest.mark.parametrize("start_batches", [0, 1, 2, 5, 7])
def test_loader_resume_yields_the_batches_an_uninterrupted_run_sees(start_batches):
    ds, b, ws = Indices(37), 3, 2
    for rank in range(ws):
        fresh_loader = build_loader(
            ds, b, shuffle=True, seed=4, rank=rank, world_size=ws, infinite=True
        )
        fresh = _batches(fresh_loader, 20)
        k = start_batches * b * ws  # global samples consumed after start_batches steps
        resumed = build_loader(
            ds, b, shuffle=True, seed=4, rank=rank, world_size=ws, start_sample=k, infinite=True
        )
        assert _batches(resumed, 20 - start_batches) == fresh[start_batches:]


def test_loader_resume_at_any_sample_multiple_of_world_size():
    ds, b, ws = Indices(30), 4, 2
    loader = build_loader(ds, b, shuffle=True, seed=0, rank=1, world_size=ws, infinite=True)
    fresh = [i for batch in _batches(loader, 12) for i in batch]  # this rank's sample stream
    for k in (2, 6, 14, 26):  # not whole global batches (8), and 26 lies in the second epoch
        sampler = ResumableDistributedSampler(
            ds, b, shuffle=True, seed=0, rank=1, world_size=ws, start_sample=k, infinite=True
        )
        assert list(itertools.islice(iter(sampler), 20)) == fresh[k // ws : k // ws + 20]
    with pytest.raises(UserError, match="multiple of world_size"):
        build_loader(ds, b, shuffle=True, seed=0, world_size=2, start_sample=3)


def test_finite_loader_walks_epochs_and_maps_positions():
    ds, b = Indices(10), 3
    loader = build_loader(ds, b, shuffle=True, seed=2)
    sampler = loader.sampler
    assert sampler.samples_per_epoch == 9 and len(loader) == 3
    epoch0 = [i for batch in loader for i in batch.flatten().tolist()]
    assert sampler.position == 9 and sampler.epoch == 1 and sampler.offset == 0
    epoch1 = [i for batch in loader for i in batch.flatten().tolist()]
    assert len(set(epoch0)) == len(set(epoch1)) == 9 and epoch0 != epoch1
    # start_sample 12 = epoch 1, offset 3: the second batch of epoch 1.
    resumed = build_loader(ds, b, shuffle=True, seed=2, start_sample=12)
    assert (resumed.sampler.epoch, resumed.sampler.offset) == (1, 3)
    resumed.sampler.set_epoch(1)  # already in epoch 1: keeps its offset
    assert [i for batch in resumed for i in batch.flatten().tolist()] == epoch1[3:]
    ordered = build_loader(ds, 5, shuffle=False, seed=0, drop_last=False)
    assert [batch.flatten().tolist() for batch in ordered] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_two_ranks_see_disjoint_samples():
    ds, b = Indices(41), 4
    seen = []
    for rank in range(2):
        loader = build_loader(ds, b, shuffle=True, seed=9, rank=rank, world_size=2)
        seen.append([i for batch in loader for i in batch.flatten().tolist()])
    assert len(seen[0]) == len(seen[1]) == 20  # 41 // 2 = 20 per rank, 5 whole batches
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0]) | set(seen[1])) == 40


def test_loader_over_shipped_text_resumes_exactly():
    ds = get_dataset("shakespeare", "val", seq_len=32, num_samples=64)
    fresh = list(itertools.islice(iter(build_loader(ds, 8, shuffle=True, seed=1)), 6))
    resumed_loader = build_loader(ds, 8, shuffle=True, seed=1, start_sample=24)
    resumed = list(itertools.islice(iter(resumed_loader), 3))
    for (x0, y0), (x1, y1) in zip(fresh[3:], resumed, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert fresh[0][0].shape == (8, 32) and fresh[0][0].dtype == torch.int64


def test_loader_rejects_datasets_too_small():
    with pytest.raises(UserError, match="too small"):
        build_loader(Indices(5), 4, shuffle=False, seed=0, world_size=2)
