"""The Checkpoint: one directory of config + safetensors, read lazily.

Opening reads config.json, the quantization config and every safetensors header.
A module's tensors are checked against the quantization config when the module is
first asked for (header-only work), so modules a recipe drops (vision tower, MTP
head) never refuse a checkpoint. Tensor data is memory-mapped on demand.

With an index, the files it lists make the checkpoint. A *.safetensors file beside
them that the index does not list (transformers and vLLM read only listed files) is
still opened, so its tensors are accounted for: a recipe may drop them, but one it
uses is refused (see Checkpoint.unlisted_file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from monolith.formats import (
    FormatError,
    NVFP4Weight,
    SafetensorsFile,
    bf16_bits_to_f32,
    dequantize_fp8,
    dequantize_nvfp4,
    from_compressed_nvfp4,
)

from .config import (
    ARCHITECTURE_ROLES,
    CONFIG_FILE,
    HF_QUANT_FILE,
    detect_architecture,
    load_json,
    read_quant_config,
    text_config_of,
)
from .errors import CheckpointError
from .experts import expert_scale, fused_experts_spec, halves_of, is_fused_experts_name
from .precision import (
    PLAIN_ALLOWED_PREFIXES,
    ModuleSpec,
    PlainAllowed,
    module_spec,
    rules_for,
)
from .resolve import resolve_checkpoint

INDEX_FILE = "model.safetensors.index.json"
HASH_CHUNK = 8 << 20


class Checkpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_path = self.path / CONFIG_FILE
        self.config = load_json(config_path)
        self.text_config = text_config_of(self.config)
        self.architecture = detect_architecture(self.config, config_path)
        self.role = ARCHITECTURE_ROLES[self.architecture]
        self.quant_format, self.quant_config, where = read_quant_config(self.path, self.config)
        self._rules = rules_for(self.quant_format, self.quant_config, where)
        self._hashes: dict[Path, str] = {}
        self._index: dict[str, str] = {}  # weight_map of the index, when there is one
        self.unlisted_files: list[Path] = []  # beside an index that does not list them
        self._unlisted: set[SafetensorsFile] = set()
        self.files = self._list_files()
        self._where = self._open_files()
        self._module_names = self._find_modules()
        self._specs: dict[str, ModuleSpec] = {}  # checked on first use

    def __repr__(self) -> str:
        return (
            f"Checkpoint({str(self.path)!r}, {self.architecture}, {self.role}, {self.quant_format}, "
            f"{len(self.files)} files, {len(self._module_names)} modules)"
        )

    # ---- files and tensors --------------------------------------------------------

    def _list_files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if not index.is_file():
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no {INDEX_FILE}")
            return files
        weight_map = load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        holder: dict[str, str] = {}  # file -> a tensor the index puts there
        for tensor, name in weight_map.items():
            if name not in holder:
                if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
                    raise CheckpointError(f"{index}: weight_map[{tensor!r}] = {name!r} is not a file in the checkpoint")
                holder[name] = tensor
        for name, tensor in holder.items():
            if not (self.path / name).is_file():
                raise CheckpointError(f"{index}: lists {name} (holding {tensor}) but {self.path / name} does not exist")
        self._index = weight_map
        self.unlisted_files = sorted(p for p in self.path.glob("*.safetensors") if p.name not in holder)
        return [self.path / name for name in sorted(holder)] + self.unlisted_files

    def _open_files(self) -> dict[str, SafetensorsFile]:
        where: dict[str, SafetensorsFile] = {}
        by_name: dict[str, SafetensorsFile] = {}
        for path in self.files:
            try:
                st = SafetensorsFile(path)
            except FormatError as e:
                raise CheckpointError(str(e)) from None
            except OSError as e:
                raise CheckpointError(f"{path}: cannot read ({e})") from None
            relative = path.relative_to(self.path).as_posix()
            for name in st.names():
                if name in where:
                    # in two files: the index says which one the checkpoint means (an
                    # other copy is not read), else it is an error
                    listed = self._index.get(name)
                    listed = Path(listed).as_posix() if isinstance(listed, str) else None
                    if listed not in (relative, where[name].path.relative_to(self.path).as_posix()):
                        raise CheckpointError(f"tensor {name} is in both {where[name].path} and {path}")
                    if listed != relative:
                        continue
                where[name] = st
            by_name[relative] = st
            if path in self.unlisted_files:
                self._unlisted.add(st)
        for tensor, name in self._index.items():
            if where.get(tensor) is not (by_name.get(name) or by_name.get(Path(name).as_posix())):
                raise CheckpointError(
                    f"{self.path / INDEX_FILE}: weight_map puts {tensor} in {name}, which has no such tensor"
                )
        return where

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name}") from None

    def tensor_names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> str:
        return self._file(name).dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).shape(name))

    def file_of(self, name: str) -> Path:
        return self._file(name).path

    def unlisted_file(self, name: str) -> Path | None:
        """The file holding tensor `name` when the index does not list that file."""
        st = self._file(name)
        return st.path if st in self._unlisted else None

    def release(self) -> None:
        """Unmap every file (pages read so far stop counting as resident memory);
        later reads map them again."""
        for st in set(self._where.values()):
            st.close()

    def read(self, name: str) -> np.ndarray:
        """The stored bits (BF16 as uint16, F8_E4M3 as uint8), memory-mapped read-only."""
        try:
            return self._file(name).read(name)
        except (FormatError, OSError) as e:
            raise CheckpointError(f"{self.file_of(name)}: {name}: cannot read ({e})") from None

    def read_float(self, name: str) -> np.ndarray:
        """A BF16/F16/F32/F64 tensor as float32."""
        dtype = self.dtype(name)
        if dtype == "BF16":
            return bf16_bits_to_f32(self.read(name))
        if dtype in ("F16", "F32", "F64"):
            return np.asarray(self.read(name), dtype=np.float32)
        raise CheckpointError(f"{self.file_of(name)}: {name}: dtype {dtype} is not a float type")

    # ---- modules ------------------------------------------------------------------

    def _find_modules(self) -> frozenset[str]:
        """Names of the linear modules (a tensor prefix with `.weight` or `.weight_packed`)."""
        names = set()
        for tensor in self._where:
            for suffix in (".weight", ".weight_packed"):
                if tensor.endswith(suffix):
                    names.add(tensor[: -len(suffix)])
        return frozenset(names)

    def module_names(self) -> list[str]:
        return sorted(self._module_names)

    def has_module(self, name: str) -> bool:
        """Whether the headers hold module `name` (nothing is checked)."""
        return name in self._module_names

    def has_fused_experts(self, name: str) -> bool:
        """Whether `name` (`...mlp.experts.gate_up_proj` or `.down_proj`) is stored as one
        stacked [E, N, K] group, in any precision (see experts.py)."""
        return is_fused_experts_name(name) and (self.has(name) or self.has(name + "_packed"))

    def module(self, name: str) -> ModuleSpec:
        """The checked ModuleSpec of a linear module or of fused experts; the
        quantization rules are applied here, on first use (the MTP head's modules may
        also be stored unquantized: precision.PLAIN_ALLOWED_PREFIXES)."""
        spec = self._specs.get(name)
        if spec is None:
            rules = PlainAllowed(self._rules) if name.startswith(PLAIN_ALLOWED_PREFIXES) else self._rules
            if name in self._module_names:
                spec = module_spec(self, name, rules)
            elif self.has_fused_experts(name):
                spec = fused_experts_spec(self, name, rules)
            else:
                raise CheckpointError(f"{self.path}: no module named {name}")
            self._specs[name] = spec
        return spec

    def modules(self) -> dict[str, ModuleSpec]:
        """Every linear module, each checked (the first bad one raises)."""
        return {name: self.module(name) for name in self.module_names()}

    def _spec(self, module: str | ModuleSpec, precision: str | None = None, expert: int | None = None) -> ModuleSpec:
        spec = self.module(module.name if isinstance(module, ModuleSpec) else module)
        if precision and spec.precision != precision:
            raise CheckpointError(f"{self.path}: module {spec.name} is {spec.precision}, not {precision}")
        fused = self.has_fused_experts(spec.name)
        if (expert is None) == fused:
            need = "needs an expert index (fused experts)" if fused else "is not fused experts (no expert index)"
            raise CheckpointError(f"{self.path}: module {spec.name} {need}")
        return spec

    def _rows(self, tensor: str, expert: int | None, rows: tuple[int, int] | None) -> np.ndarray:
        """A tensor's stored bits, or rows [a, b) of one expert of a fused tensor."""
        data = self.read(tensor)
        return data if expert is None else data[expert, rows[0] : rows[1]]

    def _scale(self, spec: ModuleSpec, role: str, expert: int | None, rows: tuple[int, int] | None) -> np.ndarray:
        """A float scale, for fused experts the one that applies to `rows` of `expert`."""
        values = self.read_float(spec.tensors[role])
        if expert is None:
            return values
        return expert_scale(values, spec.shape, halves_of(spec.name), expert, rows)

    def read_nvfp4(self, module: str | ModuleSpec, expert: int | None = None,
                   rows: tuple[int, int] | None = None) -> NVFP4Weight:
        """Codes, E4M3 block scales and the multiplicative tensor scale (for
        compressed-tensors 1 / weight_global_scale). Fused experts: rows [a, b) of
        `expert` (inside one of gate / up)."""
        spec = self._spec(module, "nvfp4", expert)
        t = spec.tensors
        if expert is not None and rows is None:
            rows = (0, spec.shape[1])
        if "weight_packed" in t:
            try:
                return from_compressed_nvfp4(
                    self._rows(t["weight_packed"], expert, rows), self._rows(t["weight_scale"], expert, rows),
                    self._scale(spec, "weight_global_scale", expert, rows),
                    name=f"{self.file_of(t['weight_global_scale'])}: {t['weight_global_scale']}",
                )
            except CheckpointError:
                raise
            except FormatError as e:
                raise CheckpointError(str(e)) from None
        scale_2 = t["weight_scale_2"]
        tensor_scale = self._scale(spec, "weight_scale_2", expert, rows).reshape(())
        if not np.isfinite(tensor_scale):
            raise CheckpointError(f"{self.file_of(scale_2)}: {scale_2}: tensor scale is not finite ({tensor_scale})")
        return NVFP4Weight(self._rows(t["weight"], expert, rows), self._rows(t["weight_scale"], expert, rows),
                           np.float32(tensor_scale))

    def read_fp8(self, module: str | ModuleSpec, expert: int | None = None,
                 rows: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(E4M3 codes uint8 [N, K], float32 scale: 0-d per tensor or [N, 1] per channel).
        Fused experts: rows [a, b) of `expert`."""
        spec = self._spec(module, "fp8", expert)
        if expert is not None and rows is None:
            rows = (0, spec.shape[1])
        scale = self._scale(spec, "weight_scale", expert, rows)
        scale = scale.reshape(()) if scale.size == 1 else scale.reshape(-1, 1)
        return self._rows(spec.tensors["weight"], expert, rows), scale

    def dequantize(self, module: str | ModuleSpec, expert: int | None = None,
                   rows: tuple[int, int] | None = None) -> np.ndarray:
        """The module's weight as float32, whatever its precision (fused experts:
        rows [a, b) of `expert`, all rows when not given)."""
        spec = self._spec(module, expert=expert)
        if expert is not None and rows is None:  # each half has its own scale
            step = spec.shape[1] // halves_of(spec.name)
            return np.concatenate([self.dequantize(spec, expert, (a, a + step)) for a in range(0, spec.shape[1], step)])
        if spec.precision == "nvfp4":
            w = self.read_nvfp4(spec, expert, rows)
            return dequantize_nvfp4(w.packed, w.scales, w.tensor_scale, name=spec.name)
        if spec.precision == "fp8":
            return dequantize_fp8(*self.read_fp8(spec, expert, rows), name=spec.name)
        bits = self._rows(spec.tensors["weight"], expert, rows)
        if self.dtype(spec.tensors["weight"]) == "BF16":
            return bf16_bits_to_f32(bits)
        return np.asarray(bits, dtype=np.float32)

    # ---- identity -----------------------------------------------------------------

    def _sha256(self, path: Path) -> str:
        if path not in self._hashes:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    h.update(chunk)
            self._hashes[path] = h.hexdigest()
        return self._hashes[path]

    def config_sha256(self) -> str:
        return self._sha256(self.path / CONFIG_FILE)

    def source_files(self) -> list[dict]:
        """Name (relative), size and SHA-256 of config.json, hf_quant_config.json and
        the safetensors index when present, and every safetensors file."""
        extra = [self.path / n for n in (CONFIG_FILE, HF_QUANT_FILE, INDEX_FILE)]
        paths = [p for p in extra if p.is_file()] + list(self.files)
        return [
            {"name": p.relative_to(self.path).as_posix(), "bytes": p.stat().st_size, "sha256": self._sha256(p)}
            for p in paths
        ]


def open_checkpoint(source: str | Path, revision: str | None = None, local_files_only: bool = False) -> Checkpoint:
    """A local checkpoint directory or a Hugging Face repo id, opened."""
    return Checkpoint(resolve_checkpoint(str(source), revision=revision, local_files_only=local_files_only))
