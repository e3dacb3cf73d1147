"""The planner on paper: formulas, pruning, --fix, the CLI's JSON and errors, one Table-1 row."""

from __future__ import annotations

import json

import pytest

from scaletrain import platform as P
from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.plan import Plan, RematPlan
from scaletrain.planner import Options, Shape, plan_cost, search
from scaletrain.planner import memory as mem
from scaletrain.planner.search import parse_fixed

A100 = P.get("a100-80g")
GPT3 = Shape(layers=96, hidden=12288, heads=96, vocab=51200, positions=2048)


def test_flops_per_iteration_is_narayanan_eq3():
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    want = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert GPT3.flops_per_iteration(B, s) == pytest.approx(want)
    # without recomputation: Korthikanti et al. (2022) model FLOPs 72·B·s·l·h^2·(1 + s/(6h) + V/(12·l·h))
    # (the head's 6·B·s·h·V is not recomputed, so it is not 72/96 of eq. (3)'s)
    model = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert GPT3.flops_per_iteration(B, s, recompute=False) == pytest.approx(model)
    # 12h^2 + 13h per layer (REFERENCES: l(12h^2 + 13h) + Vh)
    assert GPT3.layer_params() == 12 * h * h + 13 * h


def test_korthikanti_activations_and_inflight():
    sh = Shape(layers=2, hidden=1024, heads=16, vocab=512, dropout=0.1)
    s, b, h, a = 2048, 2, 1024, 16
    sbh = s * b * h
    plain = mem.layer_activation_bytes(sh, s, b, flash=False)
    assert plain == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert mem.layer_activation_bytes(sh, s, b, tp=4, flash=False) == pytest.approx(sbh * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert mem.layer_activation_bytes(sh, s, b, tp=4, sp=True, flash=False) == pytest.approx(
        sbh * (34 / 4 + 5 * a * s / (h * 4)))
    assert mem.layer_activation_bytes(sh, s, b, tp=4, sp=True, remat="selective", flash=False) == pytest.approx(sbh * 34 / 4)
    assert mem.layer_activation_bytes(sh, s, b, remat="full") == pytest.approx(2 * sbh)
    assert mem.inflight("1f1b", 4, 16) == 4 and mem.inflight("gpipe", 4, 16) == 16 and mem.inflight("1f1b", 4, 2) == 2
    assert mem.inflight("interleaved", 4, 16, 2) == pytest.approx(4 + 3 / 2)


@pytest.mark.parametrize("name, P, M, v", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("interleaved", 8, 32, 4),
                                          ("gpipe", 4, 8, 1)])
def test_closed_forms_agree_with_the_pipeline_simulator(name, P, M, v):
    from scaletrain.techniques.pipeline import schedules
    from scaletrain.techniques.pipeline.simulate import simulate

    r = simulate(schedules.build(name, P, M, v))
    assert r.peak_inflight_equiv[0] == pytest.approx(mem.inflight(name, P, M, v))
    assert r.peak_inflight_equiv[-1] == pytest.approx(mem.inflight(name, P, M, v, last=True))
    assert r.bubble_fraction == pytest.approx(((P - 1) / v) / (M + (P - 1) / v))


def test_bubble_and_zero_bytes():
    plan = Plan(dp=4, tp=8, pp=8, micro_batch=1, microbatches=96, schedule="interleaved", virtual=2,
                remat=RematPlan(blocks="all"), precision="bf16")
    c = plan_cost(GPT3, plan, A100, global_batch=384, seq=2048)
    assert c.bubble_fraction == pytest.approx((7 / 2) / (96 + 7 / 2))  # (p-1)/v of m + (p-1)/v slots
    assert sum(c.phases_s.values()) == pytest.approx(c.step_time_s)
    one = plan_cost(GPT3, plan.with_(schedule="1f1b", virtual=0), A100, global_batch=384, seq=2048)
    assert one.bubble_fraction == pytest.approx(7 / (96 + 7))  # (p-1)/(m+p-1)
    gp = plan_cost(GPT3, plan.with_(schedule="gpipe", virtual=0), A100, global_batch=384, seq=2048)
    assert gp.step_time_s == pytest.approx(one.step_time_s) and gp.peak_bytes["activations"] > one.peak_bytes["activations"]
    # ZeRO-1 shards the optimizer states (Adam 8 bytes/param, fp32 params are the masters) over dp
    z1 = plan_cost(GPT3, plan.with_(zero=1), A100, global_batch=384, seq=2048)
    n = mem.rank_params(GPT3, tp=8, pp=8, first=True, last=False)
    assert c.peak_bytes["optimizer"] == pytest.approx(8 * n) and z1.peak_bytes["optimizer"] == pytest.approx(8 * n / 4)
    assert c.peak_bytes["params"] == pytest.approx(4 * n) and c.peak_bytes["grads"] == pytest.approx(4 * n)


def test_megatron_row_within_15_percent():
    # Table 1, 145.6B: t=8, p=8, 1536 GPUs, batch 2304, micro-batch 2, 2 virtual stages -> 148 TFLOP/s
    sh = Shape(layers=80, hidden=12288, heads=96, vocab=51200, positions=2048, dropout=0.1)
    plan = Plan(dp=24, tp=8, pp=8, micro_batch=2, microbatches=48, schedule="interleaved", virtual=2,
                remat=RematPlan(blocks="all"), precision="bf16", params_dtype="bf16")
    c = plan_cost(sh, plan, A100, global_batch=2304, seq=2048, options=Options(attention="materialized", p2p_scatter=True))
    assert abs(c.tflops_per_device / 148 - 1) <= 0.15 and c.fits


def test_search_prunes_and_fixes():
    r = search(GPT3, A100, nodes=128, gpus_per_node=8, global_batch=1536, seq=2048, fixed={"tp": 8, "pp": 8})
    assert r.ranked and all(c.plan.tp == 8 and c.plan.pp == 8 and c.fits for c in r.ranked)
    assert all(c.plan.dp * c.plan.tp * c.plan.pp == 1024 for c in r.ranked)
    assert [c.step_time_s for c in r.ranked] == sorted(c.step_time_s for c in r.ranked)
    r = search(GPT3, A100, nodes=128, gpus_per_node=8, global_batch=1536, seq=2048, fixed={"pp": 1, "zero": 0})
    assert not r.ranked and any(x["kind"] == "memory" for x in r.rejected)
    sh = Shape.of("gpt2-xl")  # 25 heads, vocabulary 50257: TP is refused, in words
    r = search(sh, A100, nodes=1, gpus_per_node=8, global_batch=64, seq=1024, fixed={"remat": "full"})
    assert all(c.plan.tp == 1 and c.plan.remat.blocks == "all" for c in r.ranked)
    assert any(x["kind"] == "divisibility" and "n_head=25" in x["reason"] for x in r.rejected)
    assert parse_fixed(["tp=8", "sp=true", "remat=full"]) == {"tp": 8, "sp": True, "remat": "full"}
    for bad in (["warp=2"], ["tp=x"], ["remat=some"], ["tp"]):
        with pytest.raises(UserError):
            parse_fixed(bad)


def test_done_when_command_json(capsys, tmp_path):
    out = tmp_path / "plan.toml"
    rc = main(["plan", "--model", "gpt2-xl", "--platform", "a100-80g", "--nodes", "4", "--gpus-per-node", "8",
               "--global-batch", "512", "--seq", "1024", "--json", "--out", str(out)])
    assert rc == 0
    ranked = json.loads(capsys.readouterr().out)
    assert isinstance(ranked, list) and ranked
    times = [e["step_time_s"] for e in ranked]
    assert times == sorted(times)
    for e in ranked:
        assert e["fits"] and e["peak_bytes"] < e["device_bytes"]
        assert set(e["plan"]) >= {"dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "schedule", "remat", "offload",
                                  "precision", "optimizer"}
        for k in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu"):
            assert e[k] > 0
    from scaletrain.plan import load_plan_overrides

    from scaletrain.train.config import load_config

    keys = load_plan_overrides(out)  # what `scaletrain train --plan` reads, validated by the config schema
    assert any(k.startswith("parallel.dp=") for k in keys)
    cfg = load_config(None, keys)
    assert Plan.from_config(cfg).dp == ranked[0]["plan"]["dp"]
    entry = tmp_path / "entry.json"  # one --json entry is a plan file too
    entry.write_text(json.dumps(ranked[0]))
    assert Plan.from_config(load_config(None, load_plan_overrides(entry))) == Plan.from_config(cfg)
    main(["plan", "--model", "gpt2-xl", "--nodes", "4", "--global-batch", "512", "--seq", "1024", "--json",
          "--json-rejected", "--top", "2"])
    d = json.loads(capsys.readouterr().out)
    assert len(d["ranked"]) == 2 and d["world"] == 32 and any(r["kind"] == "divisibility" for r in d["rejected"])


def test_platform_file_and_explain(capsys, tmp_path):
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps({**P.get("a100-40g").to_dict(), "name": "my-a100"}))
    rc = main(["plan", "--model", "gpt2-medium", "--platform", str(f), "--nodes", "1", "--gpus-per-node", "8",
               "--global-batch", "64", "--seq", "1024", "--fix", "pp=2", "--top", "2", "--explain", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "my-a100" in out and "pp=2" in out and "layer_fwd" in out and "the step by phase" in out


def test_bad_platform_files_are_one_line_errors(capsys, tmp_path):
    for data, msg in (({"name": "x", "flops_bf16": "fast"}, "flops_bf16"), ({"name": "x", "warp": 1}, "warp"),
                      ({**A100.to_dict(), "inter_node_bytes_per_s": 0}, "inter_node_bytes_per_s"), ([1, 2], "JSON object")):
        f = tmp_path / "p.json"
        f.write_text(json.dumps(data))
        rc = main(["plan", "--model", "gpt2-small", "--platform", str(f), "--nodes", "2", "--global-batch", "8"])
        err = capsys.readouterr().err
        assert rc == 2 and msg in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, msg", [
    (["--global-batch", "0"], "--global-batch"),
    (["--global-batch", "8", "--platform", "tpu9"], "unknown platform"),
    (["--global-batch", "8", "--fix", "tp=3"], "no plan fits"),
    (["--global-batch", "8", "--set", "n_wings=2"], "n_wings"),
    (["--global-batch", "8", "--seq", "4096"], "n_positions"),
    (["--global-batch", "8", "--optimizer", "magic"], "magic"),
    (["--global-batch", "8", "--set", "n_head=7"], "n_head"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, msg):
    rc = main(["plan", "--model", "gpt2-small", "--nodes", "1", "--gpus-per-node", "8", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1


def test_unaligned_16bit_matmul_runs_at_the_measured_fraction():
    """A GPT-2 head (50,257 columns) on an H200 is priced on alignment-1 kernels (0.115 of peak, measured
    there); padding the vocabulary to a multiple of 8 gives it the ordinary table's fraction back."""
    from scaletrain.planner.cost import _mm

    h200 = P.get("h200")
    m, k = 16384, 1024
    flops = 2.0 * m * 50257 * k
    unaligned = _mm(h200, "bf16", m, 50257, k)
    assert unaligned == pytest.approx(flops / (h200.flops_bf16 * 0.115))
    aligned = _mm(h200, "bf16", m, 50304, k)
    assert aligned == pytest.approx(2.0 * m * 50304 * k / (h200.flops_bf16 * h200.matmul_fraction(2.0 * m * 50304 * k)
                                                            * h200.wave_fraction(m, 50304)))
    assert _mm(h200, "fp32", m, 50257, k) < 2 * _mm(h200, "fp32", m, 50304, k)  # fp32: no tensor-core penalty
    assert P.get("a100").unaligned_matmul_fraction == 0.0  # never measured there: no penalty priced


def test_adamw_step_bytes_count_torchs_foreach_kernels():
    """AdamW's priced step moves 80 B per parameter (its eight _foreach kernels) + 12 B of clipping."""
    from scaletrain.planner.cost import optimizer_step_bytes

    reads = 8 + 4 + 8 + 4 + 4 + 4 + 4 + 12  # lerp_, mul_, addcmul_, decay mul_, sqrt, div_, add_, addcdiv_
    writes = 4 * 8
    assert optimizer_step_bytes("adamw", 8) == reads + writes + 4 + 8
    assert optimizer_step_bytes("sgd", 4) == 12 + 8 + 12


def test_calibrate_reuses_a_platform_file_and_refuses_bad_input(tmp_path, capsys):
    """`scaletrain calibrate` writes what `--platform FILE.json` reads; a measured file is reused, and bad
    input is one line, exit 2."""
    from scaletrain.planner.local import calibrate_to_file

    path = tmp_path / "p.json"
    path.write_text(json.dumps(P.get("h100").with_(name="mine").to_dict()))
    plat = calibrate_to_file(2, path)  # exists: not measured again
    assert plat is not None and plat.name == "mine" and plat.flops_bf16 == P.get("h100").flops_bf16
    for argv, msg in ((["calibrate", "--nproc-per-node", "0"], "--nproc-per-node: '0'"),
                      (["calibrate", "--model", "nope"], "nope"),
                      (["calibrate", "--out", str(tmp_path / "missing" / "p.json")], "existing directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_calibrate_measures_this_machine(tmp_path, capsys):
    out = tmp_path / "here.json"
    assert main(["calibrate", "--out", str(out)]) == 0
    assert "local-cpu/1" in capsys.readouterr().out
    plat = P.Platform.from_dict(json.loads(out.read_text()))
    assert plat.name == "local-cpu/1" and plat.flops_fp32 > 0 and plat.device_mem_bytes_per_s > 0
    assert main(["plan", "--model", "gpt2-tiny", "--platform", str(out), "--nodes", "1", "--gpus-per-node", "1",
                 "--global-batch", "4", "--seq", "32", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked and ranked[0]["fits"] and ranked[0]["step_time_s"] > 0
