#!/usr/bin/env python3
"""A decode step as it runs in its CUDA graph, from `nsys stats --report cuda_gpu_trace --format csv`
of a run traced with `nsys profile --cuda-graph-trace=node` (scripts/device/profile_decode_step.sh,
NQ_SLICE_NSYS=1). ncu serialises kernels and runs them one by one; inside the graph, programmatic
launches overlap and the gaps between kernels are what launch latency costs. For the last complete
step (from the second-to-last embedding kernel to the last): the step's wall time, the kernels' busy
time, the idle time between kernels, and per kernel name the calls, time and the idle time before
them.

    python3 scripts/device/graph_step_table.py trace.csv
"""
import collections
import csv
import sys

from ncu_step_table import short_name


def column(header, *words):
    for i, name in enumerate(header):
        if all(w in name for w in words):
            return i
    raise KeyError(f"no column with {words} in {header}")


def read_trace(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if any("Start" in c for c in r))
    header = rows[start]
    at, dur, name = column(header, "Start"), column(header, "Duration"), column(header, "Name")
    events = []
    for r in rows[start + 1:]:
        if len(r) <= max(at, dur, name) or not r[at].strip():
            continue
        n = r[name]
        if n.startswith("[CUDA"):  # memcpy / memset rows
            events.append({"name": n, "start": float(r[at]), "ns": float(r[dur])})
        else:
            events.append({"name": short_name(n), "start": float(r[at]), "ns": float(r[dur])})
    events.sort(key=lambda e: e["start"])
    return events


def main():
    events = read_trace(sys.argv[1])
    starts = [i for i, e in enumerate(events) if "Embedding" in e["name"]]
    if len(starts) < 2:
        print(f"{len(events)} events, {len(starts)} embedding kernels: no whole step")
        return 1
    step = events[starts[-2]:starts[-1]]
    wall = events[starts[-1]]["start"] - step[0]["start"]
    # Busy time: the union of the events' intervals (programmatic launches overlap).
    busy, idle, reach = 0.0, 0.0, step[0]["start"]
    groups = collections.OrderedDict()
    for e in step:
        end = e["start"] + e["ns"]
        gap = max(0.0, e["start"] - reach)
        idle += gap
        busy += max(0.0, end - max(reach, e["start"]))
        reach = max(reach, end)
        g = groups.setdefault(e["name"], {"n": 0, "ns": 0.0, "gap": 0.0})
        g["n"] += 1
        g["ns"] += e["ns"]
        g["gap"] += gap
    idle += max(0.0, events[starts[-1]]["start"] - reach)
    print(f"== last whole step in its graph: {len(step)} events, wall {wall / 1e3:.1f} us, "
          f"busy {busy / 1e3:.1f} us, idle between events {idle / 1e3:.1f} us")
    print(f"{'event':64} {'calls':>5} {'us':>9} {'idle before us':>15}")
    for name, g in sorted(groups.items(), key=lambda kv: -(kv[1]["ns"] + kv[1]["gap"])):
        print(f"{name[:64]:64} {g['n']:5d} {g['ns'] / 1e3:9.1f} {g['gap'] / 1e3:15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
