"""When the consumer releases its PDL dependents: after its grid wait (today),
at its start (before the wait), or after its RMSNorm hand-off.

Why: the timeline's marks show the consumer's RMSNorm hand-off (its programs
meeting through the tagged sum-of-squares words) taking ~2.8 µs inside the
chain, while fused_wqa_wkv's 448 programs, released at the consumer's wait,
issue their 9.2 MB of weight loads at the same moment. Released at the
consumer's start instead, those loads overlap the consumer's own wait for
wo_b, when the consumer does nothing. Both settings are timed alternately in
one process (the one timer, cold L2), then each is stamped (timeline), and
fused = unfused bits are checked for each.

    PYTHONPATH=. python benchmarks/consumer_release.py [--tp-shapes 4] [--rows 1 8]
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timeline import profile  # noqa: E402

from decode_boundary.bench.harness import one_gpu_boundary, one_gpu_parser, one_gpu_result  # noqa: E402
from decode_boundary.bench.report import git_commit, write_json  # noqa: E402
from decode_boundary.boundary import consumer  # noqa: E402
from decode_boundary.common.timing import graph_time_us  # noqa: E402
from decode_boundary.model.chain import check_outputs, outputs_identical  # noqa: E402

ROUNDS = 4
RELEASES = {0: "after_wait", 1: "at_start", 2: "after_handoff"}


def main() -> None:
    args = one_gpu_parser(__doc__.splitlines()[0]).parse_args()
    ab, views = one_gpu_boundary(args, seed=3)
    result = one_gpu_result("consumer_release", args)
    result["rows"] = []
    for rows in args.rows:
        inputs = ab.make_inputs(rows, seed=rows)
        steps = [functools.partial(v, inputs, fused=True) for v in views]
        times = {r: [] for r in RELEASES}
        for _ in range(ROUNDS):
            for early in RELEASES:
                consumer.RELEASE = early
                times[early].append(graph_time_us(steps, ab.device))
        entry = {"rows": rows}
        for early in RELEASES:
            consumer.RELEASE = early
            out = ab(inputs, fused=True)
            same = outputs_identical(out, ab(inputs, fused=False))
            failures = [] if same else ["fused != unfused"]
            failures += check_outputs(out, ab.reference(inputs))
            name = RELEASES[early]
            entry[name] = {"us": times[early], "median_us": statistics.median(times[early]),
                           "failures": failures,
                           "timeline": profile(ab, views, rows, ab.device)}
            print(f"M = {rows} release {name:10s}: {statistics.median(times[early]):6.2f} µs "
                  f"({', '.join(f'{t:.2f}' for t in times[early])}) "
                  f"{'; '.join(failures) or 'checks ok'}", flush=True)
            for k in entry[name]["timeline"]["kernels"]:
                print(f"   {k['kernel']:24s} waited {k['median_waited']:6.2f} "
                      f"mark1 {k['median_mark1']:6.2f} mark2 {k['median_mark2']:6.2f} "
                      f"end {k['median_end']:6.2f} / {k['last_end']:6.2f}", flush=True)
        result["rows"].append(entry)
    consumer.RELEASE = 0
    ab.close()
    commit = git_commit() or "nocommit"
    name = f"consumer_release-{args.model}-tp{args.tp_shapes}-shapes-{commit}.json"
    print("wrote", write_json(result, args.out / name))


if __name__ == "__main__":
    main()
