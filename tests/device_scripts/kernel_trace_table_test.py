#!/usr/bin/env python3
"""kernel_trace_table.py against traces built here, whose numbers are known.

A trace of five graph replays, each two kernels (A 4 us, then B 4 us) with a 1 us copy after
them, the host's cudaGraphLaunch before and a cudaStreamSynchronize spanning each: the table must
find the replays, their span and the time between them, split that time into the copy and the
calls, and read a trace written before copies and calls were recorded (no kind column).
"""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "device", "kernel_trace_table.py")
HEADER = "start_ns,end_ns,stream,correlation,graph_id,graph_node,grid,block,name"


def trace(with_kinds):
    rows = [HEADER + (",kind" if with_kinds else "")]
    t = 0
    for step in range(5):
        c = 100 + step
        rows.append(f'{t + 1000},{t + 5000},7,{c},3,1,1x1x1,32x1x1,"A"' + (",kernel" if with_kinds else ""))
        rows.append(f'{t + 5000},{t + 9000},7,{c},3,2,1x1x1,32x1x1,"B"' + (",kernel" if with_kinds else ""))
        if with_kinds:
            rows.append(f"{t},{t + 900},0,{c - 50},0,0,,,cudaGraphLaunch_v10000,api")
            rows.append(f"{t + 9500},{t + 10500},7,{c},3,3,,,memcpy DtoH 4 B,memcpy")
            rows.append(f"{t + 1200},{t + 11000},0,{c + 60},0,0,,,cudaStreamSynchronize_v3020,api")
        t += 12000
    return "\n".join(rows) + "\n"


def table(text, *args):
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write(text)
    try:
        done = subprocess.run([sys.executable, SCRIPT, f.name, *args], capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        sys.exit(f"kernel_trace_table.py failed ({done.returncode}): {done.stderr}")
    return done.stdout


def expect(output, line):
    if line not in output:
        sys.exit(f"missing {line!r} in:\n{output}")


def main():
    new = table(trace(True), "--timeline")
    expect(new, "== 5 graph replays of 2 kernels (of 5 replays in the trace)")
    # Each replay spans A's start to B's end (8 us); 4 us pass from B's end to the next A.
    expect(new, "step span 8.0 us (median 8.0), no kernel running inside it 0.0 us, between replays 4.0 us")
    expect(new, "== between replays: copies and runtime calls, mean us inside a gap (4 gaps)")
    # Inside each 4 us gap: the synchronize's last 2 us, the whole 1 us copy, the 0.9 us launch.
    expect(new, "     2.0  api    cudaStreamSynchronize_v3020")
    expect(new, "     1.0  memcpy memcpy DtoH 4 B")
    expect(new, "     0.9  api    cudaGraphLaunch_v10000")
    expect(new, "    -7.8      2.0      0  api    cudaStreamSynchronize_v3020")
    expect(new, "     0.5      1.5      7  memcpy memcpy DtoH 4 B")
    expect(new, "     3.0      3.9      0  api    cudaGraphLaunch_v10000")
    expect(new, "     4.0     4.0     4.0      7  B  1x1x1")
    old = table(trace(False))
    expect(old, "step span 8.0 us (median 8.0), no kernel running inside it 0.0 us, between replays 4.0 us")
    if "between replays: copies" in old:
        sys.exit(f"a trace without copies or calls printed a split of the gaps:\n{old}")
    print("kernel_trace_table.py: replays, gaps and the old format as expected")


if __name__ == "__main__":
    main()
