"""Before/after check of the pipeline runtime's host terms (issue #25): one calibration, two prices, one run.

For a model of ``measured_models.py`` and some of its plan indices: this machine is measured as ``plan=auto``
measures it (2 processes), each plan is priced with the calibration as is ("after": ``pipeline_action_s``,
``p2p_send_s``, ``p2p_recv_s`` as measured) and with those three fields zeroed ("before"), then run once.
Both predictions face the same measured step, so their errors compare under whatever load the machine has.

    PYTHONPATH=src python benchmarks/planner/pipeline_host_ab.py vgg-mini 0,10,12,13,14
    PYTHONPATH=src python benchmarks/planner/pipeline_host_ab.py hf:bert 0,10,12,13,14 --predict-only
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))


def main(argv: list[str]) -> int:
    import measured_models as mm

    if len(argv) < 2 or argv[0] not in mm.MODELS:
        print(f"usage: pipeline_host_ab.py MODEL INDICES [--predict-only]; MODEL one of {', '.join(mm.MODELS)}",
              file=sys.stderr)
        return 2
    name, spec = argv[0], mm.MODELS[argv[0]]
    plans = [spec["plans"][int(i)].resolved(mm.WORLD) for i in argv[1].split(",")]
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    plat = mm.platform_for(name, "fp32")
    print(f"calibrated in {time.perf_counter() - t0:.0f} s (1-min load {load0:.1f} -> {os.getloadavg()[0]:.1f}): "
          f"pipeline_action_s {plat.pipeline_action_s * 1e6:.0f} us, p2p_send_s {plat.p2p_send_s * 1e6:.0f} us, "
          f"p2p_recv_s {plat.p2p_recv_s * 1e6:.0f} us, alpha {plat.intra_node_latency_s * 1e6:.0f} us", flush=True)
    before = plat.with_(pipeline_action_s=0.0, p2p_send_s=0.0, p2p_recv_s=0.0)
    for plan in plans:
        after_s = mm.price(name, plan, plat, spec)["step_time_s"]
        before_s = mm.price(name, plan, before, spec)["step_time_s"]
        if "--predict-only" in argv:
            print(f"{mm.label(plan)}: before {before_s * 1e3:.1f} ms, after {after_s * 1e3:.1f} ms", flush=True)
            continue
        m = mm.run(name, plan, spec)
        ms = m.get("step_time_s", float("nan"))
        print(f"{mm.label(plan)}: before {before_s * 1e3:.1f} ms ({(before_s / ms - 1) * 100:+.0f} %), after "
              f"{after_s * 1e3:.1f} ms ({(after_s / ms - 1) * 100:+.0f} %), measured {ms * 1e3:.1f} ms "
              f"{m.get('error', '')}(load {m.get('load_1min')})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
