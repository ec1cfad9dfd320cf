#!/usr/bin/env python3
"""Copy a bf16 hub checkpoint (single model.safetensors) with chosen routed experts' up_proj
scaled, so that NVFP4 quantization gives those experts gate/up weight_scale_2 values that
differ by about the factor (the mismatch `nq census` finds and the gate/up repack must fix).

  plant_gate_up_mismatch.py SRC_DIR OUT_DIR [EXPERT:FACTOR ...]   (default 0:10 1:0.1 2:3)

Every MoE layer gets the same plants. Standard library only (no numpy): bf16 values are
widened to float32, scaled, and rounded back to bf16 to nearest even.
"""
import json
import os
import shutil
import struct
import sys


def scale_bf16(data, factor):
    n = len(data) // 2
    bits = struct.unpack(f"<{n}H", data)
    out = []
    for b in bits:
        (x,) = struct.unpack("<f", struct.pack("<I", b << 16))
        (y,) = struct.unpack("<I", struct.pack("<f", x * factor))
        out.append(((y + 0x7FFF + ((y >> 16) & 1)) >> 16) & 0xFFFF)
    return struct.pack(f"<{n}H", *out)


def main():
    src, out = sys.argv[1], sys.argv[2]
    plants = {int(e): float(f) for e, f in (a.split(":") for a in (sys.argv[3:] or ["0:10", "1:0.1", "2:3"]))}
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header_bytes = f.read(n)
        data = bytearray(f.read())
    header = json.loads(header_bytes)
    planted = 0
    for name, info in header.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[6] == "up_proj" and int(parts[5]) in plants:
            assert info["dtype"] == "BF16", name
            begin, end = info["data_offsets"]
            data[begin:end] = scale_bf16(bytes(data[begin:end]), plants[int(parts[5])])
            planted += 1
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", n) + header_bytes + bytes(data))
    for file in os.listdir(src):
        path = os.path.join(src, file)
        if os.path.isfile(path) and file != "model.safetensors":
            shutil.copy(path, os.path.join(out, file))
    print(f"planted {planted} up_proj tensors ({plants}) -> {out}")


if __name__ == "__main__":
    main()
