#!/usr/bin/env python3
"""Where a graphed decode step's time goes as it runs, from nq_kernel_trace's CSV.

    python3 scripts/device/kernel_trace_table.py TRACE.csv [--steps N] [--timeline]

A step is one graph replay: the kernels sharing a graph launch's correlation id. The last N
replays with the most common kernel count are averaged. Per kernel name: calls, the sum of its
kernels' durations, and its *exposed* time, when it was the only kernel running (a kernel that
runs beside another costs the step less than its duration); then the step's span, the time no
kernel ran inside it (launch gaps, dependency waits) and the gap between replays (the host).
--timeline prints the median replay kernel by kernel (start offset, duration, stream).
A trace with copies and runtime calls (kind memcpy, api) also gets the time between replays
split: per copy or call, its mean time inside the gaps, and the median gap event by event
(offsets from the last kernel's end; a call that began earlier shows a negative start).
"""
import argparse
import bisect
import collections
import csv
import statistics
import sys


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["start"], r["end"] = int(r["start_ns"]), int(r["end_ns"])
        r["kind"] = r.get("kind") or "kernel"  # traces written before copies and calls were recorded
    kernels = [r for r in rows if r["kind"] == "kernel"]
    return kernels, [r for r in rows if r["kind"] != "kernel"]


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


def gap_breakdown(every, chosen_ids, others):
    """The copies and runtime calls overlapping each gap between two replays, one of them chosen."""
    if not others:  # a kernels-only trace: nothing to split the gaps into
        return
    others = sorted(others, key=lambda r: r["start"])
    starts = [r["start"] for r in others]
    longest = max((r["end"] - r["start"] for r in others), default=0)
    gaps = []
    for i in range(len(every) - 1):
        if id(every[i]) not in chosen_ids and id(every[i + 1]) not in chosen_ids:
            continue
        lo, hi = max(k["end"] for k in every[i]), every[i + 1][0]["start"]
        # Events starting up to the longest event's length before the gap may overlap it.
        first = bisect.bisect_left(starts, lo - longest)
        last = bisect.bisect_right(starts, hi)
        gaps.append((lo, hi, [r for r in others[first:last] if r["end"] > lo and r["start"] < hi]))
    if not gaps:
        return
    inside = collections.defaultdict(float)
    for lo, hi, events in gaps:
        for r in events:
            inside[(r["kind"], r["name"])] += min(r["end"], hi) - max(r["start"], lo)
    print(f"== between replays: copies and runtime calls, mean us inside a gap ({len(gaps)} gaps)")
    for (kind, name), total in sorted(inside.items(), key=lambda kv: -kv[1]):
        print(f"{total / len(gaps) / 1e3:8.1f}  {kind:6s} {name[:70]}")
    lo, hi, events = sorted(gaps, key=lambda g: g[1] - g[0])[len(gaps) // 2]
    print(f"== the median gap ({(hi - lo) / 1e3:.1f} us), event by event (us from the last kernel's end)")
    print(f"{'start':>8s} {'end':>8s} {'stream':>6s}  {'kind':6s} name")
    for r in events:
        print(f"{(r['start'] - lo) / 1e3:8.1f} {(r['end'] - lo) / 1e3:8.1f} {r['stream']:>6s}  {r['kind']:6s} {r['name'][:70]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--timeline", action="store_true")
    args = ap.parse_args()
    kernels, others = load(args.trace)
    chosen, every = replays(kernels, args.steps)
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
    gap_breakdown(every, chosen_ids, others)
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
