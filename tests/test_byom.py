"""Bring your own model: Hugging Face models and plain modules, unmodified, from Python and by name."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from scaletrain import models  # noqa: E402
from scaletrain.chain import to_chain  # noqa: E402
from scaletrain.cli import main  # noqa: E402
from scaletrain.models.adapters import adapt  # noqa: E402
from scaletrain.train.config import load_config  # noqa: E402
from scaletrain.train.trainer import Trainer  # noqa: E402

BASE = ["train.steps=3", "train.global_batch=4", "data.seq_len=16", "train.eval_batches=1", "train.progress=off",
        "train.log_every=1"]


def hf_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))


def fit(model, *extra):
    tr = Trainer(load_config(None, BASE + list(extra)), model=model, log=lambda s: None)
    try:
        return tr.fit()
    finally:
        tr.close()


def params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_hf_object_trains_as_given_and_through_its_chain():
    """An HF GPT-2 object goes straight to Trainer (no wrapper): same losses and weights as through
    to_chain, which equals the model's forward; the object holds the trained weights."""
    a, b = hf_gpt2(), hf_gpt2()
    before = params(a)
    ra, rb = fit(a), fit(to_chain(b))
    assert ra.losses == rb.losses and len(ra.losses) == 3
    assert ra.val_loss == rb.val_loss
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(pa[k], before[k]) for k in pa)
    assert a.lm_head.weight is a.transformer.wte.weight  # tied embeddings stay tied


def test_hf_causal_training_keeps_no_key_value_cache():
    """The adapter turns the model's key/value cache off: with it on, each layer's keys and values are
    copied into a cache that attention then saves for the backward (activations nothing reads), and
    the whole-model step would hold more than the per-block chain the cost model traces."""
    from scaletrain.measure.tracker import MemoryTracker

    x = torch.randint(0, 256, (2, 16))
    whole, chain = hf_gpt2(), to_chain(hf_gpt2())
    adapt(whole)
    saved = []
    for m in (whole, chain):
        with MemoryTracker(model=m) as t:
            out = m(x)
        saved.append(t.current_breakdown["activations"])
    assert out is not None and whole(x).past_key_values is None
    assert saved[0] == saved[1] > 0


def test_own_loss_labels_and_attention_mask():
    """The model's own loss (labels=) is used when it returns one; attention_mask and -100 padding are respected."""
    m = hf_gpt2().eval()
    ad = adapt(m)
    x = torch.randint(0, 256, (2, 12))
    out = m(input_ids=x, labels=x)
    assert ad.loss(out, None) is out.loss
    assert torch.allclose(ad.batch_loss({"input_ids": x, "labels": x}), out.loss)
    # targets already shifted (the trainer's data): the model's own loss function on all positions
    y = torch.roll(x, -1, 1)
    ref = nn.functional.cross_entropy(m(x).logits.flatten(0, 1), y.flatten())
    assert torch.allclose(ad.loss(m(x), y), ref)
    # right padding masked out: the real tokens' logits and loss are those of the unpadded sequence
    pad = torch.cat([x, torch.zeros(2, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(2, 12), torch.zeros(2, 4)], 1).long()
    labels = torch.cat([x, torch.full((2, 4), -100)], 1)
    padded = ad.forward({"input_ids": pad, "attention_mask": mask, "labels": labels})
    assert torch.allclose(padded.logits[:, :12], out.logits, atol=1e-5)
    assert torch.allclose(padded.loss, out.loss, atol=1e-6)


def test_llama_and_bert_chains_equal_forward_and_train():
    """Llama (rotary, RMSNorm) and BERT (bidirectional) blocks found by to_chain run like the model; BERT trains
    as a masked LM on the shipped text with its own masking."""
    T = transformers
    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                             max_position_embeddings=32, bos_token_id=None, eos_token_id=None))
    bert = T.BertForMaskedLM(T.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=2, vocab_size=257, max_position_embeddings=32,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    x = torch.randint(0, 256, (2, 16))
    for m in (llama, bert):
        m.eval()
        c = to_chain(m)
        assert len(c) == 4
        assert torch.equal(c(x), m(x).logits)
    r = fit(bert)
    assert len(r.losses) == 3 and all(torch.isfinite(torch.tensor(r.losses)))


def test_handback_after_offload_equals_plain_run():
    """Offloading streams weights through 0-byte parameters (0 bytes left without the hand-back, checked by
    hand); after fit() the user's object holds the trained
    values in usable storage, equal to a plain run's."""
    plain, off = hf_gpt2(), hf_gpt2()
    ref = fit(plain)
    ids = {id(p) for p in off.parameters()}
    res = fit(off, "memory.offload.plan=auto", "memory.device_budget=400KiB")
    assert res.losses == pytest.approx(ref.losses, rel=1e-6)
    assert {id(p) for p in off.parameters()} == ids  # the same parameter objects
    assert all(p.untyped_storage().nbytes() > 0 for p in off.parameters())
    pp, po = params(plain), params(off)
    assert all(torch.allclose(pp[k], po[k], rtol=1e-5, atol=1e-7) for k in pp)
    off(torch.zeros(1, 4, dtype=torch.long))  # usable


FACTORY = '''
from torch import nn

def make(width=8, classes=10):
    """A torchvision-style classifier for 8x8 grey digits: Conv2d first, Linear head last."""
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * width, classes))
'''


def test_py_factory_and_names(tmp_path, monkeypatch, capsys):
    """py:module:factory gets model.overrides as keywords and trains on digits; hf: families build from overrides;
    an unknown name is one line, exit 2."""
    (tmp_path / "byom_user_model.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    m = models.get("py:byom_user_model:make", width=4)
    assert m[0].out_channels == 4 and adapt(m).task == "classify" and adapt(m).channels == 1
    tr = Trainer(load_config(None, BASE + ["model.name=py:byom_user_model:make", "model.overrides.width=4",
                                           "data.image_size=8"]), log=lambda s: None)
    try:
        assert tr.data_name == "digits"
        r = tr.fit()
    finally:
        tr.close()
    assert "val_acc" in r.val_metrics
    g = models.get("hf:gpt2", n_layer=1, n_embd=16, n_head=2)
    assert len(g.transformer.h) == 1 and g.config.vocab_size == 256
    assert models.get("hf:llama", num_hidden_layers=1, device="meta").model.embed_tokens.weight.is_meta
    saved = hf_gpt2()
    saved.save_pretrained(tmp_path / "local")  # hf:/path: config.json + safetensors
    loaded = models.get(f"hf:{tmp_path / 'local'}")
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))
    for argv in (["train", "model.name=hf:nope"], ["estimate", "--model", "hf:gpt2", "--set", "n_layr=2"],
                 ["train", "model.name=py:no_such_module:f"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("hf:" in err or "py:" in err), err


def test_estimate_names_hf_llama():
    """`scaletrain estimate --model hf:llama --set ...` predicts a step of the HF model, nothing allocated."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["estimate", "--model", "hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=32",
                   "--set", "intermediate_size=64", "--batch", "2", "--seq", "16", "--json"])
    assert rc == 0
    est = json.loads(out.getvalue())
    n = sum(p.numel() for p in models.get("hf:llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          device="meta").parameters())
    assert est["parameters"] == n
    assert est["bytes"]["parameters"] == 4 * n


def test_public_surface():
    """Short, stable import paths (README "Bring your own model")."""
    import scaletrain
    from scaletrain import estimate, offload, remat
    from scaletrain.optim import CAME, LAMB, LARS, Adafactor, Adam8bit, AdamW8bit, CPUAdam

    assert scaletrain.Trainer is Trainer and scaletrain.load_config is load_config and scaletrain.adapt is adapt
    assert scaletrain.Config.__name__ == "Config" and scaletrain.Plan.__name__ == "Plan"
    assert all(issubclass(c, torch.optim.Optimizer) for c in (CAME, LAMB, LARS, Adafactor, Adam8bit, AdamW8bit,
                                                                CPUAdam))
    assert callable(remat.plan) and callable(offload.build_offload_runtime)
    est = estimate.estimate_step(hf_gpt2(), 2, 16)  # an HF object: shapes from its adapter
    assert est.bytes["parameters"] == 4 * sum(p.numel() for p in hf_gpt2().parameters())


def test_hf_dir_in_every_command(tmp_path, capsys):
    """`estimate|remat|profile|pipeline --model hf:/dir` on a saved directory: the shape commands build it from
    config.json on the meta device (from_pretrained refuses meta), with --set fields applied; a field the config
    lacks is one line."""
    saved = hf_gpt2()
    saved.save_pretrained(tmp_path / "local")
    name = f"hf:{tmp_path / 'local'}"
    n = sum(p.numel() for p in saved.parameters())
    assert main(["estimate", "--model", name, "--seq", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == n
    assert main(["estimate", "--model", name, "--seq", "16", "--set", "n_layer=1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] < n  # the override reached the config
    for argv in (["remat", "--model", name, "--seq", "16", "--budget", "1GiB", "--methods", "none", "--json"],
                 ["profile", "--model", name, "--seq", "16", "--repeats", "1", "--warmup", "0", "--json"],
                 ["pipeline", "--model", name, "--seq", "16", "--ranks", "2", "--microbatches", "2", "--json"]):
        assert main(argv) == 0, (argv, capsys.readouterr().err)
        assert json.loads(capsys.readouterr().out), argv
    assert main(["estimate", "--model", name, "--set", "bogus=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bogus" in err, err
