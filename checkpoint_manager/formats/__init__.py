"""Checkpoints in and out of the formats other tools read: Hugging Face safetensors, PEFT adapters,
single-file tar bundles, and conversions between DCP, safetensors and ``torch.save`` files."""

from checkpoint_manager.formats.bundle import (
    BundleInfo,
    extract_bundle,
    is_bundle,
    list_bundle,
    open_bundle,
    pack_bundle,
    resolve_checkpoint_path,
)
from checkpoint_manager.formats.convert import (
    convert,
    dcp_to_safetensors,
    dcp_to_torch,
    detect_format,
    plain_dcp_to_dcp,
    safetensors_to_dcp,
    safetensors_to_torch,
    torch_to_dcp,
    torch_to_safetensors,
    write_weights_checkpoint,
)
from checkpoint_manager.formats.hf import HFExport, HFLoad, export_hf, is_hf_weights, load_hf_weights
from checkpoint_manager.formats.peft import PeftExport, export_peft_adapter
from checkpoint_manager.formats.sizes import parse_size

__all__ = [
    "BundleInfo",
    "HFExport",
    "HFLoad",
    "PeftExport",
    "convert",
    "dcp_to_safetensors",
    "dcp_to_torch",
    "detect_format",
    "export_hf",
    "export_peft_adapter",
    "extract_bundle",
    "is_bundle",
    "is_hf_weights",
    "list_bundle",
    "load_hf_weights",
    "open_bundle",
    "pack_bundle",
    "parse_size",
    "plain_dcp_to_dcp",
    "resolve_checkpoint_path",
    "safetensors_to_dcp",
    "safetensors_to_torch",
    "torch_to_dcp",
    "torch_to_safetensors",
    "write_weights_checkpoint",
]
