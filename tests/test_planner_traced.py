"""The planner for any model the runtime trains (priced by its fake-tensor trace): properties, never timings."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import scaletrain
from scaletrain.cli import main
from scaletrain.errors import UserError

BERT = ["--set", "num_hidden_layers=2", "--set", "hidden_size=32", "--set", "num_attention_heads=2",
        "--set", "intermediate_size=64"]
BERT_OVER = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def test_python_and_cli_rank_the_same_plans_for_a_non_decoder(capsys):
    """hf:bert is planned (not refused as 'not a decoder shape'); scaletrain.plan(...) returns the CLI's
    --json list; tensor parallelism is pruned by the compatibility table with the rule named."""
    got = scaletrain.plan("hf:bert", platform="a100-80g", devices=2, global_batch=4, seq=32, overrides=BERT_OVER,
                          fix={"zero": 0, "pp": 1})
    assert got and all(g["fits"] and g["step_time_s"] > 0 and g["peak_bytes"] > 0 for g in got)
    assert [g["step_time_s"] for g in got] == sorted(g["step_time_s"] for g in got)
    assert main(["plan", "--model", "hf:bert", *BERT, "--gpus-per-node", "2", "--global-batch", "4", "--seq", "32",
                 "--fix", "zero=0", "--fix", "pp=1", "--top", "100", "--json", "--json-rejected"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["describe"] for r in out["ranked"]] == [g["describe"] for g in got]
    assert [r["step_time_s"] for r in out["ranked"]] == pytest.approx([g["step_time_s"] for g in got])
    tp = [r for r in out["rejected"] if r["region"].startswith("tp=2")]
    assert tp and tp[0]["kind"] == "compat" and tp[0]["reason"].startswith("mp-model")


def test_moe_plans_search_expert_parallelism():
    got = scaletrain.plan("gpt2-moe", platform="a100-80g", devices=2, global_batch=4, seq=32,
                          fix={"tp": 1, "pp": 1, "zero": 0, "remat": "none"})
    eps = {g["plan"]["ep"] for g in got}
    assert eps == {1, 2}, eps
    one = next(g for g in got if g["plan"]["ep"] == 1 and g["plan"]["micro_batch"] == 2)
    two = next(g for g in got if g["plan"]["ep"] == 2 and g["plan"]["micro_batch"] == 2)
    assert two["peak_bytes"] < one["peak_bytes"]  # each rank holds half the experts (and their states)


def test_what_cannot_be_priced_is_one_line(capsys):
    for argv in (["--fix", "cp=2"], ["--timeline", "t.png"], ["--fix", "attention=flash"], ["--fix", "tp=2"]):
        assert main(["plan", "--model", "mlp", "--gpus-per-node", "2", "--global-batch", "4", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
    assert "mp-model" in err[0]  # tp=2 on an MLP: the rule that removed it
    with pytest.raises(UserError, match="ep"):
        scaletrain.plan("gpt2-tiny", devices=2, global_batch=4, fix={"ep": 2})


def test_plan_auto_picks_a_plan_for_a_non_decoder_and_it_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--json", "plan=auto", "model.name=mlp", "train.steps=2",
                 "train.global_batch=8", "train.eval_every=0", "train.progress=off", "train.log_every=1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["predicted_step_time_s"] > 0 and summary["predicted_peak_bytes"] > 0
    assert 'plan = "manual"' in (out / "config.toml").read_text()


def test_micro_batches_are_not_capped():
    got = scaletrain.plan("gpt2-tiny", devices=1, global_batch=256, seq=64, fix={"micro_batch": 128})
    assert got and all(g["plan"]["micro_batch"] == 128 for g in got)


def test_no_plan_fits_names_the_rule_that_removed_a_pinned_pipeline():
    # 10 layers on 4 ranks run (the runtime's uneven split); 16 stages for 12 blocks do not
    got = scaletrain.plan("gpt2-small", devices=8, global_batch=8, seq=512, overrides={"n_layer": 10}, fix={"pp": 4})
    assert got and all(sum(g["stage_layers"]) == 10 and len(g["stage_layers"]) == 4 for g in got)
    with pytest.raises(UserError, match=r"no plan fits: .*compat rule pp-blocks"):
        scaletrain.plan("gpt2-small", devices=16, global_batch=16, seq=512, overrides={"n_layer": 10},
                        fix={"pp": 16})


class _Net(nn.Sequential):
    """A model object handed to scaletrain.plan: 64 features in, 10 classes out."""

    task = "classify"

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        return torch.empty(batch, 64, device="meta")


def test_a_model_object_is_planned_and_one_without_an_input_is_one_line():
    got = scaletrain.plan(_Net(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), devices=2, global_batch=8,
                          fix={"zero": 0, "pp": 1})
    assert got and {g["plan"]["dp"] for g in got} == {2}
    bare = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with pytest.raises(UserError, match="input_spec") as e:
        scaletrain.plan(bare, devices=2, global_batch=8, fix={"zero": 0, "pp": 1})
    assert "\n" not in str(e.value)


def test_zero_bubble_is_searched_for_traced_models_and_refused_on_paper():
    got = scaletrain.plan("hf:gpt2", devices=2, global_batch=4, seq=32, overrides={"n_layer": 2, "n_embd": 32,
                          "n_head": 2}, fix={"pp": 2, "schedule": "zb1p", "micro_batch": 1})
    assert got and all(g["plan"]["schedule"] == "zb1p" for g in got)
    with pytest.raises(UserError, match="analytic planner prices"):
        scaletrain.plan("gpt2-tiny", devices=2, global_batch=4, fix={"schedule": "zb1p"})


def test_params_dtype_and_attention_are_pinnable_on_paper():
    got = scaletrain.plan("gpt2-tiny", devices=2, global_batch=8, seq=64,
                          fix={"params_dtype": "bf16", "attention": "materialized"})
    assert got and all(g["plan"]["params_dtype"] == "bf16" for g in got)


def _plan_json(capsys, model: str, *argv: str, nodes: int = 1) -> list:
    assert main(["plan", "--model", model, "--nodes", str(nodes), "--gpus-per-node", "2", "--global-batch", "4",
                 "--seq", "32", "--top", "100", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # the ranked plans


def test_fix_cp_hsdp_and_pp_split_are_pinned_and_priced_for_traced_models(capsys):
    # cp: priced by the trace where the runtime's ring attention runs (HF GPT-2), else the table's one line
    got = _plan_json(capsys, "hf:gpt2", "--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--fix",
                     "cp=2", "--fix", "zero=0", "--fix", "remat=none", "--fix", "micro_batch=2")
    assert got and all(r["plan"]["cp"] == 2 and r["plan"]["dp"] == 1 for r in got)
    assert main(["plan", "--model", "vgg-mini", "--gpus-per-node", "2", "--global-batch", "4", "--fix", "cp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compat rule mp-model" in err[0], err
    # hsdp: ZeRO within groups of 2 of the 4 dp ranks (2 nodes), sharded states twice those over all 4
    fix = ["--fix", "pp=1", "--fix", "zero=1", "--fix", "remat=none", "--fix", "micro_batch=1"]
    hsdp = _plan_json(capsys, "hf:bert", *BERT, *fix, "--fix", "hsdp=2", nodes=2)
    flat = _plan_json(capsys, "hf:bert", *BERT, *fix, "--fix", "hsdp=0", nodes=2)
    assert [r["plan"]["hsdp"] for r in hsdp] == [2] and [r["plan"]["hsdp"] for r in flat] == [0]
    opt = [r[0]["peak_bytes_by_category"]["optimizer"] for r in (hsdp, flat)]
    assert opt[0] == pytest.approx(2 * opt[1], rel=0.01)
    # pp_split: the runtime's equal block counts instead of its profile split, priced by the trace
    fix = ["--fix", "pp=2", "--fix", "zero=0", "--fix", "micro_batch=1", "--fix", "schedule=1f1b"]
    equal = _plan_json(capsys, "vgg-mini", *fix, "--fix", "pp_split=equal")
    profile = _plan_json(capsys, "vgg-mini", *fix)
    assert [r["plan"]["balance"] for r in equal] == ["equal"] and [r["plan"]["balance"] for r in profile] == ["profile"]
    assert equal[0]["peak_bytes"] != profile[0]["peak_bytes"]


def test_traced_search_offloads_the_optimizer_where_nothing_else_fits_and_the_plan_runs(tmp_path, capsys):
    """mlp (0.63M parameters: 10 MB of fp32 weights, gradients and Adam states) on a device with 8 MiB to plan:
    nothing fits with the optimizer on the device, so the search offloads it (ZeRO-Offload) and the plan's
    predicted peak is the offload runtime's, which the run measures; --fix offload=optimizer is priced beside
    the plain plan where both fit (less device memory, never less time)."""
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"name": "tiny", "device_memory_bytes": 2 * 2**30 + 8 * 2**20}))  # 2 GiB reserved
    base = ["plan", "--model", "mlp", "--gpus-per-node", "1", "--global-batch", "8", "--fix", "micro_batch=8",
            "--precision", "fp32", "--json"]
    assert main([*base, "--platform", str(tiny), "--out", str(tmp_path / "plan.toml")]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["plan"]["offload"]["optimizer"] == "host" and best["peak_bytes"] <= 8 * 2**20
    assert main([*base, "--platform", str(tiny), "--fix", "offload=none"]) == 2
    assert "no plan fits" in capsys.readouterr().err
    tiny.write_text(json.dumps({"name": "tiny", "device_memory_bytes": 2 * 2**30 + 8 * 2**20,
                                "host_memory_bytes": 4 * 2**20}))  # masters and Adam states need 7.2 MiB
    assert main([*base, "--platform", str(tiny)]) == 2
    assert "of host memory" in capsys.readouterr().err
    ranked = {}
    for o in ("optimizer", "none"):  # the default platform (80 GB): both fit
        assert main([*base, "--fix", f"offload={o}"]) == 0
        ranked[o] = json.loads(capsys.readouterr().out)
    pinned, plain = ranked["optimizer"], ranked["none"]
    assert {r["plan"]["offload"]["optimizer"] for r in pinned} == {"host"}
    assert plain[0]["plan"]["offload"]["optimizer"] == "device"
    assert pinned[0]["peak_bytes"] < plain[0]["peak_bytes"] and pinned[0]["step_time_s"] > plain[0]["step_time_s"]
    run = tmp_path / "run"
    assert main(["train", "--plan", str(tmp_path / "plan.toml"), "--out", str(run), "model.name=mlp",
                 "train.global_batch=8", "train.steps=1", "train.eval_every=0", "train.progress=off",
                 "train.log_every=1"]) == 0
    row = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "offload_device_peak_bytes" in r)
    assert row["offload_device_peak_pred_bytes"] == best["peak_bytes"]  # the planner prices what the run predicts
    assert row["offload_device_peak_bytes"] == pytest.approx(best["peak_bytes"], rel=0.05)


def test_traced_search_offloads_activations_where_that_is_faster_than_recomputing(tmp_path, capsys):
    """hf:gpt2 (traced) on one device with 14 MiB to plan, micro-batch 4 x 64 tokens: nothing fits on the
    device (16.4 MiB with every block recomputed), nor with only the optimizer on the host unless every block
    is recomputed (8.8 MiB); with the saved activations on the host too it fits (11.8 MiB) without recomputing, so it is
    predicted faster and ranked first; --fix offload=weights streams the weights as well (less device
    memory), and the analytic planner refuses the traced-only kinds in one line."""
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"name": "tiny", "device_memory_bytes": 2 * 2**30 + 14 * 2**20}))
    base = ["plan", "--model", "hf:gpt2", "--platform", str(tiny), "--gpus-per-node", "1", "--global-batch", "4",
            "--seq", "64", "--fix", "micro_batch=4", "--precision", "fp32", "--json", "--top", "100"]
    assert main(base) == 0
    ranked = json.loads(capsys.readouterr().out)
    kinds = [(r["plan"]["offload"]["activations"], r["plan"]["offload"]["recompute"]) for r in ranked]
    assert kinds[0] == ("all", "none") and ("none", "all") in kinds, kinds
    assert ranked[0]["step_time_s"] < next(r["step_time_s"] for r in ranked
                                           if r["plan"]["offload"]["recompute"] == "all")
    assert all(r["peak_bytes"] <= 14 * 2**20 for r in ranked)
    assert main([*base, "--fix", "offload=weights"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed and {r["plan"]["offload"]["params"] for r in streamed} == {"host"}
    assert min(r["peak_bytes"] for r in streamed) < ranked[0]["peak_bytes"]
    assert main(["plan", "--model", "gpt2-mini", "--global-batch", "8", "--fix", "offload=activations"]) == 2
    assert "analytic planner prices none, optimizer only" in capsys.readouterr().err
