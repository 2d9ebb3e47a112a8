"""Quantized checkpoints of the tiny test models, written from each format's specification.

Every linear weight of the decoder layers is rounded to the nearest 4-bit / fp8 value (RTN, seeded
random act-order permutations for GPTQ), then stored as the format stores it: AutoAWQ's GEMM packing,
GPTQ's (zeros minus one, g_idx), compressed-tensors' pack-quantized (packed by the compressed-tensors
library itself), fp8 with per-tensor or 128x128 block scales. `dequantized_copy` writes the same
model with the exact dequantized weights in float32: the reference for formats whose transformers
integration needs a GPU package (AWQ and GPTQ need gptqmodel, which does not install on this CPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
STATIC_INPUT_SCALE = 0.01  # every layer's static fp8 input scale (activations up to 4.48)  # AWQ word nibble i holds column 8j + AWQ_ORDER[i]


def _linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in state if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS]


def rtn_int4(
    weight: torch.Tensor, groups: torch.Tensor, num_groups: int, sym: bool
) -> tuple[torch.Tensor, ...]:
    """weight [N, K] float32, groups [K] (the group of each input column) -> q [N, K] in 0..15,
    scales [N, G], zeros [N, G] (integers; 8 when symmetric), with W ~= (q - z[g]) * s[g]."""
    n = weight.shape[0]
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups)
    for g in range(num_groups):
        cols = weight[:, groups == g]
        if sym:
            scales[:, g] = cols.abs().amax(1).clamp(min=1e-8) / 7.5
            zeros[:, g] = 8
        else:
            lo, hi = cols.amin(1), cols.amax(1)
            scales[:, g] = ((hi - lo) / 15).clamp(min=1e-8)
            zeros[:, g] = (-lo / scales[:, g]).round().clamp(0, 15)
    s, z = scales[:, groups], zeros[:, groups]
    q = (weight / s + z).round().clamp(0, 15)
    return q.to(torch.int64), scales, zeros.to(torch.int64)


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] in 0..15 -> [R, C / 8] int32, nibble i of word j = column 8j + order[i]."""
    v = values.reshape(values.shape[0], -1, 8)[:, :, list(order)].to(torch.int64)
    words = (v << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _copy_folder(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)


def _write(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any] | None
) -> Path:
    _copy_folder(src, dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def int4_checkpoint(
    src: Path, dst: Path, fmt: str, group_size: int, sym: bool = False, act_order: bool = False, seed: int = 0,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[Path, dict[str, torch.Tensor]]:  # fmt: skip
    """The model of `src` in `fmt` ("awq", "gptq", "compressed-tensors"); also returns the dequantized
    float32 weights by name (for `dequantized_copy`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name not in _linear_weights(state):
            out[name] = tensor
            continue
        base = name.removesuffix(".weight")
        weight = tensor.float()
        n, k = weight.shape
        g = group_size if group_size > 0 else k
        num_groups = k // g
        if act_order:  # one order per input: the shards of a fused layer share it, as GPTQ's do
            layer = int(name.split(".")[2])
            kind = name.split(".")[-2]
            shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(kind, kind)
            generator = torch.Generator().manual_seed(seed + 100 * layer + PROJECTIONS.index(shared))
            rank = torch.empty(k, dtype=torch.int64)
            rank[torch.randperm(k, generator=generator)] = torch.arange(k)
            groups = rank // g
        else:
            groups = torch.arange(k) // g
        q, scales, zeros = rtn_int4(weight, groups, num_groups, sym)
        scales = scales.to(scale_dtype)
        dense[name] = (q - zeros[:, groups]).float() * scales.float()[:, groups]
        if fmt == "awq":
            out[f"{base}.qweight"] = pack_nibbles(q.t(), AWQ_ORDER)
            out[f"{base}.qzeros"] = pack_nibbles(zeros.t(), AWQ_ORDER)
            out[f"{base}.scales"] = scales.t()
        elif fmt == "gptq":
            out[f"{base}.qweight"] = pack_nibbles(q).t()  # [K/8, N]: packed along the input
            out[f"{base}.qzeros"] = pack_nibbles((zeros - 1).t() & 0xF)  # the original format stores z - 1
            out[f"{base}.scales"] = scales.t()
            out[f"{base}.g_idx"] = groups.to(torch.int32)
        else:
            out[f"{base}.weight_packed"] = pack_to_int32((q - 8).to(torch.int8), 4)
            out[f"{base}.weight_scale"] = scales
            out[f"{base}.weight_shape"] = torch.tensor([n, k])
            if not sym:
                out[f"{base}.weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0)
            if act_order:
                out[f"{base}.weight_g_idx"] = groups.to(torch.int32)
    if fmt == "awq":
        config = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
    elif fmt == "gptq":
        config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": sym,
                  "checkpoint_format": "gptq"}  # fmt: skip
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "group" if group_size > 0 else "channel",
                   "group_size": group_size if group_size > 0 else None,
                   "actorder": "group" if act_order else None}  # fmt: skip
        config = _ct_config(weights, None, "pack-quantized")
    return _write(src, dst, out, config), dense


def _ct_config(weights: dict[str, Any], activations: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "format": fmt,
            }
        },
    }


def dequantized_copy(src: Path, dst: Path, dense: dict[str, torch.Tensor]) -> Path:
    """`src`'s model with the given float32 weights replacing its linear ones, unquantized."""
    state = load_file(str(src / "model.safetensors"))
    state.update(dense)
    return _write(src, dst, state, None)


def fp8_checkpoint(src: Path, dst: Path, scheme: str, static: bool = False) -> Path:
    """`scheme`: "block" (quant_method fp8, weight_block_size [128, 128], weight_scale_inv), "tensor"
    (quant_method fp8, per-tensor weight_scale), "ct-channel" / "ct-tensor" (compressed-tensors
    float-quantized). `static` adds per-tensor input scales (activation_scheme static)."""
    fp8, fp8_max = torch.float8_e4m3fn, 448.0
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name not in _linear_weights(state):
            out[name] = tensor
            continue
        base = name.removesuffix(".weight")
        w = tensor.float()
        n, k = w.shape
        if scheme == "block":
            blocks = w.reshape(n // 128, 128, k // 128, 128)
            scale = blocks.abs().amax(dim=(1, 3)) / fp8_max
            q = (blocks / scale[:, None, :, None]).reshape(n, k).to(fp8)
            out[f"{base}.weight"], out[f"{base}.weight_scale_inv"] = q, scale
        elif scheme == "ct-channel":
            scale = w.abs().amax(1, keepdim=True) / fp8_max
            out[f"{base}.weight"], out[f"{base}.weight_scale"] = (w / scale).to(fp8), scale
        else:
            scale = w.abs().amax() / fp8_max
            out[f"{base}.weight"], out[f"{base}.weight_scale"] = (
                (w / scale).to(fp8),
                scale.reshape(1 if "ct" in scheme else ()),
            )
        if static:
            out[f"{base}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE]).reshape(
                1 if "ct" in scheme else ()
            )
    if scheme.startswith("ct"):
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": False,
            "strategy": scheme[3:],
        }
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                "strategy": "tensor" if static else "token"}  # fmt: skip
        config = _ct_config(weights, acts, "float-quantized")
    else:
        config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
        if scheme == "block":
            config["weight_block_size"] = [128, 128]
    return _write(src, dst, out, config)


def fp8_dequantized(src: Path, quantized: Path, dst: Path) -> Path:
    """The float32 model of an fp8 checkpoint of `src` (weight * its per-tensor or per-channel scale)."""
    state = load_file(str(quantized / "model.safetensors"))
    dense = {}
    for name in _linear_weights(state):
        scale = state[name.removesuffix("weight") + "weight_scale"].float()
        dense[name] = state[name].float() * (scale if scale.dim() == 2 else scale.reshape(()))
    return dequantized_copy(src, dst, dense)
