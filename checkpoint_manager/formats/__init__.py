"""Checkpoints in and out of the formats other tools read: Hugging Face safetensors, PEFT adapters,
single-file tar bundles, and conversions between DCP, safetensors and ``torch.save`` files."""

from checkpoint_manager.formats.bundle import (
    BundleInfo,
    BundleLimits,
    CacheEntry,
    clear_bundle_cache,
    extract_bundle,
    is_bundle,
    list_bundle,
    list_bundle_cache,
    open_bundle,
    read_bundle_metadata,
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
from checkpoint_manager.formats.hf import (
    HFExport,
    HFLoad,
    MissingConfigWarning,
    export_hf,
    is_hf_weights,
    load_hf_weights,
)
from checkpoint_manager.formats.pack import pack_bundle
from checkpoint_manager.formats.peft import PeftExport, export_peft, export_peft_adapter
from checkpoint_manager.formats.resolve import resolve_checkpoint_path
from checkpoint_manager.formats.sizes import parse_size
from checkpoint_manager.formats.tensor_groups import open_checkpoint

__all__ = [
    "BundleInfo",
    "BundleLimits",
    "CacheEntry",
    "HFExport",
    "HFLoad",
    "MissingConfigWarning",
    "PeftExport",
    "clear_bundle_cache",
    "convert",
    "dcp_to_safetensors",
    "dcp_to_torch",
    "detect_format",
    "export_hf",
    "export_peft",
    "export_peft_adapter",
    "extract_bundle",
    "is_bundle",
    "is_hf_weights",
    "list_bundle",
    "list_bundle_cache",
    "load_hf_weights",
    "open_bundle",
    "open_checkpoint",
    "pack_bundle",
    "parse_size",
    "plain_dcp_to_dcp",
    "read_bundle_metadata",
    "resolve_checkpoint_path",
    "safetensors_to_dcp",
    "safetensors_to_torch",
    "torch_to_dcp",
    "torch_to_safetensors",
    "write_weights_checkpoint",
]
