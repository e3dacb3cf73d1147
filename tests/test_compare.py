"""``scaletrain compare``: the report from synthetic cells, resumability, one real cell, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.compare import findings, matrix, report, results, runner
from scaletrain.measure.phases import breakdown

MiB = 2**20


def _cell(strategy: str, devices: int, *, step: float = 0.1, peak: float = 100 * MiB, val: float = 3.0,
          model: str = "gpt2-mini", status: str = "ok", error: str = "") -> dict:
    c = results.new_cell(matrix.build((model,), (strategy,), (devices,))[0])
    c.update(status=status, error=error)
    if status == "ok":
        c["runs"] = [{"repeat": 0, "status": "ok", "step_times_s": [step * 0.9, step, step * 1.1], "step_time_s": step,
                      "peak_bytes": peak, "val": [[4, 4 * step, val + 1], [8, 8 * step, val]],
                      "peak_breakdown": {"model_states": peak / 2, "activations": peak / 3, "other": peak / 6},
                      "time_breakdown_s": {"forward": step / 3, "backward": step / 2, "optimizer": step / 12,
                                           "data": 0.0, "comm_exposed": step / 12, "other": 0.0}}]
        c["predicted_step_time_s"], c["predicted_peak_bytes"] = step * 0.8, peak * 1.05
        results.aggregate(c)
    return c


def synthetic() -> list[dict]:
    """A study in which every finding's rule holds, a failed cell and a peer not installed."""
    return [_cell("ddp", 1, step=0.4, peak=160 * MiB), _cell("ddp", 2, step=0.22, peak=130 * MiB),
            _cell("ddp", 4, step=0.12, peak=120 * MiB),
            _cell("zero3", 2, step=0.25, peak=80 * MiB), _cell("zero3", 4, step=0.14, peak=60 * MiB),
            _cell("tp", 2, step=0.5, peak=90 * MiB), _cell("tp", 4, step=0.6, peak=110 * MiB),
            _cell("tp2-dp", 4, step=0.3, peak=80 * MiB),
            _cell("1f1b", 2, step=0.3, peak=100 * MiB), _cell("1f1b", 4, step=0.2, peak=90 * MiB),
            _cell("pipedream2bw", 2, step=0.3, peak=90 * MiB, val=3.2),
            _cell("pipedream2bw", 4, status="failed", error="rank 1 died (SIGSEGV)"),
            _cell("deepspeed-zero3", 2, status="not installed", error="`import deepspeed` fails here")]


def test_report_renders_every_figure_finding_and_failed_cell() -> None:
    cells = synthetic()
    page = report.render(cells, {"command": "scaletrain compare --quick", "repeats": 1, "settings": {}})
    assert page.count('src="data:image/png;base64,') == len(report.figs.FIGURES) == 4
    for key in report.figs.FIGURES:
        assert f'id="fig-{key}"' in page
    for f in findings.FINDINGS:
        assert f.claim.replace("'", "&#x27;") in page
    assert "rank 1 died (SIGSEGV)" in page and "not installed" in page
    verdicts = {r["key"]: r["verdict"] for r in findings.judge(cells)}
    assert set(verdicts.values()) == {"reproduced"}, verdicts


def test_findings_rules_can_say_not_reproduced() -> None:
    cells = synthetic()
    for c in cells:
        if c["strategy"] == "zero3":
            c["peak_bytes"] = 0.9 * 120 * MiB  # 90 % of DDP's: outside 42-66 %
        if c["strategy"] == "tp" and c["devices"] == 4:
            c["peak_bytes"] = 70 * MiB  # monotone: no U
        if c["strategy"] == "pipedream2bw":
            c["val"] = [[4, 0.5, 4.0], [8, 1.0, 3.0 * (1 + 5e-5)]]  # worse by rounding only
    verdicts = {r["key"]: r["verdict"] for r in findings.judge(cells)}
    assert verdicts["zero_memory"] == verdicts["tp_u_shape"] == verdicts["async_staleness"] == "not reproduced"


def test_resume_skips_finished_cells_and_interleaves_repeats(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple[str, int]] = []

    def fake(cell, repeat, directory, timeout_s=0.0):
        if len(calls) == 3 and not getattr(fake, "killed", False):
            fake.killed = True
            raise KeyboardInterrupt  # the study is stopped in flight
        calls.append((cell.key, repeat))
        return {"repeat": repeat, "status": "ok", "step_times_s": [0.1], "step_time_s": 0.1, "val": [[1, 0.1, 1.0]],
                "wall_s": 1.0}

    monkeypatch.setattr(runner, "run_once", fake)
    monkeypatch.setattr(runner.predicting, "calibrate", lambda *a, **k: None)
    cells = matrix.build(("vgg-mini",), ("ddp",), (1, 2))
    with pytest.raises(KeyboardInterrupt):
        runner.run_study(cells, tmp_path, repeats=2, log=lambda s: None)
    assert calls == [("vgg-mini/ddp/1d", 0), ("vgg-mini/ddp/2d", 0), ("vgg-mini/ddp/2d", 1)]  # rotated
    recs = runner.run_study(cells, tmp_path, repeats=2, log=lambda s: None)
    assert calls[3:] == [("vgg-mini/ddp/1d", 1)]  # only the repeat left
    assert [r["status"] for r in recs] == ["ok", "ok"] and all(len(r["runs"]) == 2 for r in recs)
    runner.run_study(cells, tmp_path, repeats=2, log=lambda s: None)
    assert len(calls) == 4  # nothing rerun
    assert len(json.loads((tmp_path / "results.json").read_text())) == 2


def test_phase_breakdown_moves_nested_communication() -> None:
    main_th, gloo = 1, 2
    ev = [("DistributedDataParallel.forward", main_th, 0, 100), ("c10d::allreduce_", main_th, 40, 60),
          ("autograd::engine::evaluate_function: AddmmBackward0", main_th, 100, 250),
          ("_c10d_functional::wait_tensor", main_th, 200, 210),  # DTensor TP's wait inside the backward
          ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", main_th, 250, 260),
          ("Optimizer.step#AdamW.step", main_th, 260, 300), ("aten::mul", main_th, 270, 280),
          ("c10d::send", main_th, 300, 330), ("gloo:all_reduce", gloo, 120, 200)]
    b = breakdown(ev, main_th, (0, 400))
    us = {k: round(v * 1e6) for k, v in b.items()}
    assert us == {"forward": 80, "backward": 140, "optimizer": 40, "data": 10, "comm_exposed": 60, "other": 70,
                  "comm_background_s": 80, "step_s": 400}


def test_read_run_excludes_warmup_and_instrumented_steps(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 1.0, "step_time_s": t} for s, t in enumerate([9.0, 5.0, 1.0, 2.0, 3.0, 8.0, 7.0], 1)]
    rows += [{"step": 4, "val_loss": 2.5}, {"step": 7, "val_loss": 2.0}]
    rows.append({"step": 7, "predicted_step_time_s": 0.5, "predicted_peak_bytes": 280.0,  # plan=auto's own
                 "tracked_peak_bytes_max": 300, "tracked_peak_breakdown": {
        "parameters": 10, "gradients": 20, "optimizer_states": 30, "activations": 200, "temporaries": 30, "other": 10}})
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run = results.read_run(tmp_path / "m.jsonl", steps=7, profile_step=6, metric="val_loss")
    assert run["step_times_s"] == [1.0, 2.0, 3.0] and run["step_time_s"] == 2.0
    assert run["val"] == [[4, 17.0, 2.5], [7, 24.0, 2.0]]  # steps 6 and 7 counted at the median (2 s)
    assert run["peak_bytes"] == 300 and run["peak_breakdown"] == {"model_states": 60, "activations": 200, "other": 40}
    assert (run["predicted_step_time_s"], run["predicted_peak_bytes"]) == (0.5, 280.0)


def test_blocked_cells_say_why_without_running() -> None:
    why = {c.key: runner.blocked(c) for c in matrix.build(("vgg-mini", "gpt2-mini"), ("tp", "auto", "1f1b"), (1, 2))}
    assert why["vgg-mini/tp/2d"][0] == "not applicable" and "GPT-2-style" in why["vgg-mini/tp/2d"][1]
    assert why["vgg-mini/auto/2d"][0] == "not applicable" and why["vgg-mini/auto/2d"][1].startswith("plan=auto: ")
    assert why["gpt2-mini/1f1b/1d"] == ("not applicable", "on 1 device 1f1b is the one-process run (the ddp cell "
                                                          "at 1 device)")
    assert why["gpt2-mini/1f1b/2d"] is None and why["gpt2-mini/auto/1d"] is None and why["vgg-mini/1f1b/2d"] is None


def test_asynchronous_pipelines_are_not_profiled() -> None:
    sync, async_ = matrix.build(("vgg-mini",), ("1f1b", "pipedream2bw"), (2,), steps=12)
    assert "train.profile_step=11" in sync.train_overrides() and sync.profile_step == 11
    assert "train.profile_step=0" in async_.train_overrides() and async_.profile_step == 0


@pytest.mark.parametrize("argv, says", [
    (["--strategies", "ddp,nope"], "unknown strategy 'nope'; allowed: ddp, zero1"),
    (["--devices", "1,x"], "--devices '1,x' is not allowed"),
    (["--devices", "0,2"], "--devices '0,2' is not allowed"),
    (["--models", "gpt2-huge"], "unknown model 'gpt2-huge'; allowed: gpt2-mini, vgg-mini"),
])
def test_bad_input_is_one_line_exit_2(argv: list[str], says: str, tmp_path: Path, capsys) -> None:
    assert main(["compare", "--out", str(tmp_path / "s"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaletrain: error: ") and says in err[0], err
    assert not (tmp_path / "s").exists()


def test_one_real_cell_end_to_end(tmp_path: Path, capsys) -> None:
    out = tmp_path / "study"
    assert main(["compare", "--models", "vgg-mini", "--devices", "1", "--strategies", "ddp,tp", "--steps", "6",
                 "--repeats", "1", "--out", str(out), "--json"]) == 0
    cells = {c["key"]: c for c in json.loads((out / "results.json").read_text())}
    ddp, tp = cells["vgg-mini/ddp/1d"], cells["vgg-mini/tp/1d"]
    assert ddp["status"] == "ok", ddp["error"]
    assert ddp["step_time_s"] > 0 and ddp["peak_bytes"] > 0 and ddp["predicted_peak_bytes"] > 0
    assert abs(ddp["predicted_peak_bytes"] / ddp["peak_bytes"] - 1) < 0.25
    assert [v[0] for v in ddp["val"]] == [2, 4, 6] and all(v[1] > 0 for v in ddp["val"])
    assert set(ddp["time_breakdown_s"]) >= {"forward", "backward", "optimizer", "data", "comm_exposed", "other"}
    assert tp["status"] == "not applicable" and "one-process run" in tp["error"]
    assert (out / ddp["runs"][0]["dir"] / "metrics.jsonl").is_file()
    assert not (out / ddp["runs"][0]["dir"] / "checkpoints").exists()
    assert "vgg-mini,ddp,scaletrain,1,ok" in (out / "results.csv").read_text()
    assert "data:image/png;base64," in (out / "report.html").read_text()
    assert json.loads(capsys.readouterr().out)["status"] == {"ok": 1, "not applicable": 1}


def test_continued_study_keeps_its_start_and_adds_seconds(tmp_path: Path) -> None:
    from scaletrain.compare import environment

    first = {"start": {"date": "d0"}, "end": {"date": "e0"}, "command": "scaletrain compare --quick", "seconds": 400.0}
    environment.save(first, tmp_path)
    again = environment.save({"start": {"date": "d1"}, "end": {"date": "e1"}, "command": "scaletrain compare",
                              "seconds": 2.0}, tmp_path, ran=False)
    assert (again["start"], again["end"], again["command"], again["seconds"], again["sessions"]) == \
        ({"date": "d0"}, {"date": "e0"}, "scaletrain compare --quick", 402.0, 2)
    more = environment.save({"start": {"date": "d2"}, "end": {"date": "e2"}, "command": "x", "seconds": 9.0}, tmp_path)
    assert (more["end"], more["seconds"], more["sessions"]) == ({"date": "e2"}, 411.0, 3)


def test_prediction_of_a_gpt2_cell_has_time_phases_and_peak() -> None:
    from scaletrain import platform
    from scaletrain.compare.predict import predict

    cell = matrix.build(("gpt2-mini",), ("1f1b",), (2,))[0]
    got = predict(cell, platform.get("a100-80g"))
    assert got["predicted_peak_bytes"] > 0 and got["predicted_step_time_s"] > 0
    phases = got["predicted_time_breakdown_s"]
    assert set(phases) == {"forward+backward", "optimizer", "comm_exposed"} and phases["forward+backward"] > 0
    assert sum(phases.values()) <= got["predicted_step_time_s"] * 1.0001
    none = predict(cell, None)  # no calibration: the peak still, the step time with its reason
    assert none["predicted_step_time_s"] is None and "no calibration" in none["predicted_note"]


def test_resnet_layouts_run_on_digits_and_on_224_pixel_noise() -> None:
    """The survey's ResNet as a layout: ``resnet-mini`` on digits, and ``resnet-mini-224`` (the same model with the
    ImageNet stem on 224 x 224 synthetic images, for throughput) — its keys reach the run, the compatibility
    table and the cost model (a peak predicted on the meta device)."""
    from scaletrain.compare import matrix, predict, runner

    cell = matrix.build(("resnet-mini-224",), ("zero3",), (2,))[0]
    keys = cell.train_overrides()
    assert "model.name=resnet-mini" in keys and "data.name=synthetic-images" in keys
    assert "model.overrides.image_size=224" in keys
    assert runner.blocked(cell) is None
    small = predict.predict(matrix.build(("resnet-mini",), ("zero3",), (2,))[0], None)["predicted_peak_bytes"]
    big = predict.predict(cell, None)["predicted_peak_bytes"]
    assert small and big and big > small  # 224 x 224 activations outweigh the larger batch of 32 x 32 ones
