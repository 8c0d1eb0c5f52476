"""The trust boundary of a checkpoint: what a checkpoint from elsewhere can make a resume do.

Two checks, both before any file of the checkpoint is loaded:

1. **Checksums.** The completion record a save writes last lists every file's SHA-256
   (`file_digests`). A file that differs from it (edited, swapped, damaged by a copy) is
   refused by name (`digest_mismatches`). This catches accidents and careless edits; it is
   no defence against someone who can also rewrite the record, so:
2. **No code in pickles.** torch.save archives, DeepSpeed's model states and ZeRO shards
   (which DeepSpeed loads with `weights_only=False`) and torch distributed checkpoint's
   `.metadata` (read by a plain `pickle.load`) are pickles, and unpickling can call any
   importable function. `pickle_globals` walks a pickle's opcodes without executing them and
   lists every global it would import; `unsafe_globals` keeps those outside the allow-list:
   torch's own weights-only set, numpy's array rebuild, and the data classes of DeepSpeed's and
   torch distributed checkpoint's states, as measured on real ZeRO-2, ZeRO-3 and FSDP2
   checkpoints. A pickle that needs anything else is refused naming the file and the global.

Files a resume never loads (`training_args.bin`, DeepSpeed's `zero_to_fp32.py`) are not
checked here; docs/faults.md says not to load or run them from a checkpoint one did not make.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickletools
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

DIGEST = "sha256"
_READ_BYTES = 8 << 20
# files that are pickles by kind: torch.save archives (zip or the legacy stream of pickles) and
# torch distributed checkpoint's metadata; a .distcp file is raw storage bytes whose objects
# torch reads with weights_only=True
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle")
PICKLE_NAMES = (".metadata",)
# loaded by no resume (the Trainer saves it for the record; it pickles the whole arguments object)
NEVER_LOADED = ("training_args.bin",)
# torch's legacy (non-zip) format is five pickles in a row before the raw storage bytes
_LEGACY_TORCH_PICKLES = 5

# beyond torch's weights-only globals: what real checkpoints pickle (measured on ZeRO-2, ZeRO-3
# and FSDP2 saves of transformers 5.24, DeepSpeed 0.19, torch 2.13). Each is a data class, an
# enum or an array rebuild: constructing it runs no code of the file's choosing.
CHECKPOINT_GLOBALS: FrozenSet[str] = frozenset(
    {
        # the Trainer's RNG state (numpy's generator state)
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "_codecs.encode",
        # DeepSpeed optimizer states and model states
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
        # torch distributed checkpoint's metadata (FSDP2 through accelerate)
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.serialization._get_layout",
        "torch.Size",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "collections.OrderedDict",
        "collections.defaultdict",
        "builtins.set",
        "builtins.frozenset",
        "builtins.slice",
        "builtins.bytearray",
        "builtins.complex",
    }
)
# numpy's dtype classes (numpy.dtypes.Float64DType, ...) rebuild a dtype and nothing else
_CHECKPOINT_PREFIXES = ("numpy.dtypes.",)


class UntrustedCheckpointError(ValueError):
    """A checkpoint file that would run code when loaded, or that differs from the checksum its
    save recorded; the message names the file and what was found."""


def _torch_allowed_globals() -> Set[str]:
    """torch's weights-only unpickler's own allow-list (tensor rebuilds, storages, dtypes);
    empty where this torch has no such list (then CHECKPOINT_GLOBALS and dtypes by name)."""
    try:
        from torch import _weights_only_unpickler as wo  # torch's private list, stable since 2.4
        from torch.serialization import get_safe_globals

        names = set(wo._get_allowed_globals())
        for g in get_safe_globals():
            obj = g[0] if isinstance(g, tuple) else g
            names.add(f"{obj.__module__}.{obj.__qualname__}")
        return names
    except (ImportError, AttributeError):  # pragma: no cover - older or future torch
        return set()


_ALLOWED: Optional[FrozenSet[str]] = None


def allowed_globals(extra: Iterable[str] = ()) -> FrozenSet[str]:
    """The globals a checkpoint's pickles may import, plus `extra` (cp_checkpoint_allowed_globals)."""
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = frozenset(CHECKPOINT_GLOBALS | _torch_allowed_globals())
    return _ALLOWED | frozenset(extra) if extra else _ALLOWED


class _Opaque:
    """A value on the simulated pickle stack that is not a string."""


_OPAQUE = _Opaque()
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}


def pickle_globals(data: Union[bytes, BinaryIO], pickles: int = 1) -> Tuple[Set[str], int]:
    """The globals ("module.name") the first `pickles` pickles of `data` (bytes, or a binary file
    read from its position: a legacy torch file is not read past its pickles) import, found by
    walking their opcodes with a symbolic stack (nothing is executed), and the byte offset after
    the last one. Raises ValueError when a global cannot be resolved statically (a module or name
    computed at load time, the copyreg extension registry) or `data` is not a pickle."""
    found: Set[str] = set()
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    for _ in range(pickles):
        at = stream.tell()
        if not stream.read(1):
            break
        stream.seek(at)
        stack: List[object] = []
        marks: List[List[object]] = []
        memo: Dict[int, object] = {}
        for op, arg, pos in pickletools.genops(stream):
            name = op.name
            if name == "MARK":
                marks.append(stack)
                stack = []
                continue
            if name in _STRING_OPS:
                stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg, _OPAQUE))
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else _OPAQUE
                continue
            if name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1] if stack else _OPAQUE
                continue
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.add(f"{module}.{attr}")
                if name == "INST":
                    stack = marks.pop() if marks else []
                stack.append(_OPAQUE)
                continue
            if name == "STACK_GLOBAL":
                attr = stack.pop() if stack else _OPAQUE
                module = stack.pop() if stack else _OPAQUE
                if not (isinstance(module, str) and isinstance(attr, str)):
                    raise ValueError(f"a global at byte {pos} whose module or name is computed while loading")
                found.add(f"{module}.{attr}")
                stack.append(_OPAQUE)
                continue
            if name in ("EXT1", "EXT2", "EXT4"):
                raise ValueError(f"a global at byte {pos} taken from copyreg's extension registry")
            if name == "STOP":
                break
            before = op.stack_before
            if pickletools.markobject in before:  # the items since the mark, then those before it
                stack = marks.pop() if marks else []
                before = before[: before.index(pickletools.markobject)]
            for _ in before:
                if stack:
                    stack.pop()
            stack.extend(_OPAQUE for _ in op.stack_after)
    return found, stream.tell()


def _pickle_imports(path: Path) -> Tuple[Set[str], str]:
    """The globals every pickle of `path` imports: each .pkl entry of a torch.save zip archive,
    the leading pickles of torch's legacy format, or the file as one pickle; and the entry being
    read when a ValueError is raised."""
    found: Set[str] = set()
    with open(path, "rb") as fh:
        if fh.read(4) == b"PK\x03\x04":
            fh.seek(0)
            with zipfile.ZipFile(fh) as z:
                for e in z.infolist():
                    if e.filename.endswith(".pkl"):
                        try:
                            found |= pickle_globals(z.read(e))[0]
                        except ValueError as err:
                            raise ValueError(f"its entry {e.filename}: {err}") from err
            return found, ""
        fh.seek(0)
        # a legacy torch.save is a pickled magic number and four more pickles, then raw storage
        count = _LEGACY_TORCH_PICKLES if path.suffix in (".pt", ".pth", ".bin") else 1
        return pickle_globals(fh, count)[0], ""


def is_pickle_file(path: Path) -> bool:
    return (path.suffix.lower() in PICKLE_SUFFIXES or path.name in PICKLE_NAMES) and path.name not in NEVER_LOADED


def unsafe_globals(path: Path, extra: Iterable[str] = ()) -> List[str]:
    """The globals `path`'s pickles import outside allowed_globals(extra), sorted; raises
    UntrustedCheckpointError when a pickle cannot be read statically."""
    allowed = allowed_globals(extra)
    try:
        names, _ = _pickle_imports(path)
    except (ValueError, zipfile.BadZipFile, EOFError, IndexError) as e:
        raise UntrustedCheckpointError(
            f"checkpoint file {path} cannot be checked for code before loading: it is not a pickle whose "
            f"imports can be read without running it ({e or type(e).__name__})"
        ) from e
    bad = {n for n in names if n not in allowed and not n.startswith(_CHECKPOINT_PREFIXES)}
    return sorted(bad)


def refuse_code_in_pickles(checkpoint: Path, files: Sequence[Path], extra: Iterable[str] = ()) -> None:
    """Raise UntrustedCheckpointError naming the first of `files` whose pickles would import
    anything beyond allowed_globals(extra)."""
    for f in files:
        if not is_pickle_file(f):
            continue
        bad = unsafe_globals(f, extra)
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise UntrustedCheckpointError(
                f"checkpoint file {f} could run code when loaded: its pickle imports {shown}, beyond the "
                f"data the Trainer's, DeepSpeed's and torch distributed checkpoint's states hold. Nothing of "
                f"{checkpoint} was loaded. If you made this checkpoint and trust every file in it, name "
                f"the globals in cp_checkpoint_allowed_globals"
            )


def _digest(path: Path) -> str:
    h = hashlib.new(DIGEST)
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_BYTES):
            h.update(chunk)  # hashlib releases the GIL: the threads below hash in parallel
    return h.hexdigest()


def hashing_threads() -> int:
    """Threads that hash a checkpoint: this process's share of the host's cores."""
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return max(1, min(8, (os.cpu_count() or 1) // local))


def file_digests(root: Path, names: Sequence[str]) -> Dict[str, str]:
    """{name: sha256 hex} of the files `names` (relative to `root`), hashed in parallel."""
    with ThreadPoolExecutor(hashing_threads()) as pool:
        return dict(zip(names, pool.map(lambda n: _digest(root / n), names)))


def digest_mismatches(root: Path, recorded: Mapping[str, str], files: Iterable[Path]) -> Optional[Tuple[Path, str]]:
    """The first of `files` (under `root`) that `recorded` lists with another digest, and its
    digest now; None when every listed file matches. Files `recorded` does not list are left
    to the caller."""
    listed = [f for f in files if f.relative_to(root).as_posix() in recorded]
    if not listed:
        return None
    names = [f.relative_to(root).as_posix() for f in listed]
    now = file_digests(root, names)
    for f, name in zip(listed, names):
        if now[name] != recorded[name]:
            return f, now[name]
    return None
