"""``+model=hf``: the model directory's weight files, refused before any process starts when
they would load wrong or from elsewhere.

Weight headers are read by ``safetensors`` (dtypes checked before loading); the index's
entries and the files' resolved paths must stay inside the model directory. Weights are
loaded only from ``*.safetensors`` (:func:`tp_fuse.launch.models.hf.build_hf_model`
refuses a directory with pickled weights only).
"""

from __future__ import annotations

import glob
import json
import os

from tp_fuse.safe_files import open_regular_file, read_regular_file

__all__ = ["JSON_LIMIT", "check_weight_files"]

#: safetensors dtypes loaded as they are. Others are refused: transformers would cast an
#: int8 / uint8 / fp8 tensor to the run's float dtype without its quantization scales,
#: giving a model that loads and trains on garbage weights.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: Kept where the tensor is not a ``.weight``: buffers some checkpoints carry (Pythia's
#: causal mask ``attention.bias`` is BOOL, position ids are I64); transformers drops or
#: keeps them as they are, it never casts them into a float weight.
_BUFFER_DTYPES = ("BOOL", "I64")
#: config.json and model.safetensors.index.json: a few kB (an index: ~100 B per tensor).
JSON_LIMIT = 64 * 2**20
_INDEX_FILE = "model.safetensors.index.json"


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` (symbolic links resolved) lies in the directory ``root``."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root


def _safetensors_dtypes(file: str) -> dict[str, str]:
    """``{tensor name: dtype}`` from a safetensors file's header, read by the ``safetensors``
    library (which bounds the header at 100 MB, checks it is a JSON object of tensor entries
    and that their offsets fit the file; it reads no tensor data). The file is first checked
    to be a regular file (not a FIFO or device: ``tp_fuse.safe_files``)."""
    # Imported here: safetensors comes with the `hf` extra (transformers needs it), not with tp-fuse.
    from safetensors import SafetensorError, safe_open

    with open_regular_file(file, "model.path: weight file", follow_symlinks=True):
        pass
    try:
        with safe_open(file, framework="pt") as f:
            return {name: f.get_slice(name).get_dtype() for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"model.path: {file} is not a readable safetensors file: {e}") from None


def check_weight_files(path: str) -> None:
    """Refuse weights that would load wrong or from elsewhere, before any process starts.

    * ``model.safetensors.index.json`` entries must name files in ``path`` itself (not
      ``../x``, not absolute): transformers joins them to ``path`` and opens the result;
    * every ``*.safetensors`` file (found or named by the index) must lie in ``path`` once
      symbolic links are resolved;
    * every tensor must be float (F16/BF16/F32/F64): transformers casts int8 / uint8 /
      fp8 tensors to the run's dtype without their quantization scales (BOOL / I64 buffers
      that are not a ``.weight``, such as causal masks, are left to transformers).
    """
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, _INDEX_FILE)
    if os.path.lexists(index):
        try:
            doc = json.loads(read_regular_file(index, JSON_LIMIT, "model.path: weight index", follow_symlinks=True))
        except ValueError as e:
            raise ValueError(f"model.path: {index} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"model.path: {index} is JSON nested too deeply to be a weight index") from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.path: {index} must hold an object with a weight_map object")
        for tensor, name in weight_map.items():
            if (not isinstance(name, str) or not name or os.path.isabs(name) or os.sep in name
                    or (os.altsep and os.altsep in name) or name in (".", "..")):
                raise ValueError(f"model.path: {index}: weight_map[{tensor!r}] = {name!r} must be a file name in "
                                 f"{path} (no directory part, not absolute); refusing to load weights from elsewhere")
            files.append(os.path.join(path, name))
    for file in dict.fromkeys(files):  # in order, once each
        if not _inside(file, path):
            raise ValueError(f"model.path: {file} resolves to {os.path.realpath(file)}, outside {path}; refusing "
                             f"to load weights from outside the model directory (a Hugging Face cache snapshot "
                             f"links into ../../blobs: copy it with `cp -rL` into a directory of its own)")
        if not os.path.exists(file):
            raise ValueError(f"model.path: {file} (named in {_INDEX_FILE}) does not exist")
        for tensor, dtype in _safetensors_dtypes(file).items():
            if dtype not in _FLOAT_DTYPES and (dtype not in _BUFFER_DTYPES or tensor.endswith(".weight")):
                raise ValueError(f"model.path: {file}: tensor {tensor!r} has dtype {dtype}; only float weights "
                                 f"({', '.join(_FLOAT_DTYPES)}) are loaded (an integer or fp8 tensor would be cast "
                                 f"to float without its quantization scales). Dequantize the checkpoint first")
