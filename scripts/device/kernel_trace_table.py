#!/usr/bin/env python3
"""Where a graphed decode step's time goes as it runs, from nq_kernel_trace's CSV.

    python3 scripts/device/kernel_trace_table.py TRACE.csv [--steps N] [--timeline]

A step is one graph replay: the kernels sharing a graph launch's correlation id. The last N
replays with the most common kernel count are averaged. Per kernel name: calls, the sum of its
kernels' durations, and its *exposed* time, when it was the only kernel running (a kernel that
runs beside another costs the step less than its duration); then the step's span, the time no
kernel ran inside it (launch gaps, dependency waits) and the gap between replays (the host).
--timeline prints the median replay kernel by kernel (start offset, duration, stream).
"""
import argparse
import collections
import csv
import statistics
import sys


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["start"], r["end"] = int(r["start_ns"]), int(r["end_ns"])
    return rows


def replays(rows, steps):
    by_launch = collections.OrderedDict()
    for r in rows:
        if r["graph_id"] != "0":
            by_launch.setdefault(r["correlation"], []).append(r)
    groups = [sorted(g, key=lambda r: r["start"]) for g in by_launch.values()]
    groups.sort(key=lambda g: g[0]["start"])
    if not groups:
        sys.exit("no graph replays in the trace")
    common = collections.Counter(len(g) for g in groups).most_common(1)[0][0]
    chosen = [g for g in groups if len(g) == common][-steps:]
    return chosen, groups


def exposed_times(kernels):
    """Per kernel index: the time it ran while no other kernel did (a sweep over the edges)."""
    events = []
    for i, k in enumerate(kernels):
        events.append((k["start"], 1, i))
        events.append((k["end"], -1, i))
    events.sort(key=lambda e: (e[0], e[1]))
    running, last, alone = set(), None, collections.defaultdict(int)
    busy = 0
    for t, kind, i in events:
        if last is not None and running:
            busy += t - last
            if len(running) == 1:
                alone[next(iter(running))] += t - last
        if kind == 1:
            running.add(i)
        else:
            running.discard(i)
        last = t
    return alone, busy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--timeline", action="store_true")
    args = ap.parse_args()
    chosen, every = replays(load(args.trace), args.steps)
    spans, idles, per_name = [], [], collections.defaultdict(lambda: [0, 0.0, 0.0])
    for g in chosen:
        alone, busy = exposed_times(g)
        span = max(k["end"] for k in g) - g[0]["start"]
        spans.append(span)
        idles.append(span - busy)
        for i, k in enumerate(g):
            entry = per_name[k["name"]]
            entry[0] += 1
            entry[1] += k["end"] - k["start"]
            entry[2] += alone.get(i, 0)
    n = len(chosen)
    starts = [g[0]["start"] for g in every]
    ends = [max(k["end"] for k in g) for g in every]
    chosen_ids = {id(g) for g in chosen}  # by identity: comparing the replays' lists by value costs O(n^2)
    between = [starts[i + 1] - ends[i] for i in range(len(every) - 1)
               if id(every[i]) in chosen_ids or id(every[i + 1]) in chosen_ids]
    span_us = statistics.mean(spans) / 1e3
    print(f"== {n} graph replays of {len(chosen[0])} kernels (of {len(every)} replays in the trace)")
    print(f"step span {span_us:.1f} us (median {statistics.median(spans) / 1e3:.1f}), no kernel running inside it "
          f"{statistics.mean(idles) / 1e3:.1f} us, between replays {statistics.mean(between) / 1e3 if between else 0:.1f} us")
    print(f"{'kernel':64s} {'calls':>5s} {'sum us':>8s} {'exposed':>8s} {'share':>6s}")
    for name, (calls, total, alone) in sorted(per_name.items(), key=lambda kv: -kv[1][2]):
        print(f"{name[:64]:64s} {calls / n:5.0f} {total / n / 1e3:8.1f} {alone / n / 1e3:8.1f} "
              f"{alone / n / 1e3 / span_us:6.3f}")
    if args.timeline:
        median = sorted(chosen, key=lambda g: max(k["end"] for k in g) - g[0]["start"])[n // 2]
        t0 = median[0]["start"]
        alone, _ = exposed_times(median)
        print(f"== the median replay, kernel by kernel (us from its first start)")
        print(f"{'start':>8s} {'dur':>7s} {'alone':>7s} {'stream':>6s}  kernel  grid")
        for i, k in enumerate(median):
            print(f"{(k['start'] - t0) / 1e3:8.1f} {(k['end'] - k['start']) / 1e3:7.1f} {alone.get(i, 0) / 1e3:7.1f} "
                  f"{k['stream']:>6s}  {k['name'][:70]}  {k['grid']}")


if __name__ == "__main__":
    main()
