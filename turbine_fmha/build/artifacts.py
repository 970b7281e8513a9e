"""The artifact store: reading, validating and verifying an artifact directory.

An artifact directory holds manifest.json and the vmfb files it lists. The
whole manifest is validated when a Session opens the directory, so a broken
one fails there, naming the file and the field, rather than at some later
call. Each vmfb is verified (inside the directory, built by this IREE
release, sha256 as listed) when it is first loaded.

Trust: a vmfb is native code that the runtime maps and runs. These checks
catch damage and mistakes (a truncated copy, a stale or hand-edited
manifest, another compiler's artifacts), not someone who can write the
directory: they can rewrite the manifest's hashes too. An artifact directory
must be trusted like code. Services that want more pin the manifest's digest
(Session(manifest_sha256=...)), which through the per-artifact sha256s pins
every vmfb it lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath

from .targets import DEFAULT_BINDING_ALIGNMENT

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1

_HEX64 = re.compile(r"[0-9a-f]{64}")


class ArtifactError(RuntimeError):
    """An artifact directory or artifact is malformed, missing, corrupted,
    not the pinned one, or from another IREE release."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: Path
    sha256: str  # of the file's bytes, as read
    data: dict  # validated

    @property
    def artifacts(self) -> list[dict]:
        return self.data["artifacts"]


# JSON's names for Python's types; bool before int (a bool is an int).
_JSON_TYPES = (
    (type(None), "null"),
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _json_type(value) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(value, t)), type(value).__name__)


def _is(value, kind: str) -> bool:
    # bool is an int in Python but not in the manifest's schema.
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return _json_type(value) == kind


# Fields of an artifact entry: (JSON type, required). Required: what the
# runtime needs to pick and verify an artifact. kernel_abi may be missing in
# entries of old builds, which are then skipped like any other ABI. The
# optional ones are what build() and the CLI read.
_ENTRY_FIELDS = {
    "variant": ("string", True),
    "target": ("string", True),
    "path": ("string", True),
    "sha256": ("string", True),
    "compiler_version": ("string", True),
    "kernel_abi": ("integer", False),
    "driver": ("string", False),
    "mlir": ("string", False),
    "size": ("integer", False),
    "source_sha256": ("string", False),
    "flags": ("array", False),
    # The alignment in bytes the kernels assume of their arguments' memory
    # (targets.Target.binding_alignment); missing: DEFAULT_BINDING_ALIGNMENT.
    "binding_alignment": ("integer", False),
    "compile_seconds": ("number", False),
    "isa": ("object", False),
    # The function's ABI (kernels/abi.py; the manifest's top-level "abi"
    # says what its names and ids mean).
    "abi": ("object", False),
    # CPU targets: what a CPU needs to run the artifact (core/cpu.py).
    "cpu_arch": ("string", False),
    "cpu_requires": ("array", False),
}


def _relative_inside(p: str) -> bool:
    pp = PurePosixPath(p)
    return bool(p) and "\0" not in p and not pp.is_absolute() and ".." not in pp.parts and not p.startswith("\\")


def validate(data, path: Path) -> None:
    """Raises ArtifactError naming `path` and the field for anything in a
    parsed manifest that the runtime or build() could trip over."""

    def bad(field: str, problem: str):
        raise ArtifactError(f"{path}: {field}: {problem}")

    if not isinstance(data, dict):
        bad("(top level)", f"expected an object, got {_json_type(data)}")
    if "manifest_version" not in data:
        bad("manifest_version", "missing")
    version = data["manifest_version"]
    if not _is(version, "integer"):
        bad("manifest_version", f"expected an integer, got {_json_type(version)}")
    if version != MANIFEST_VERSION:
        bad(
            "manifest_version",
            f"{version} is not supported (this turbine-fmha reads version {MANIFEST_VERSION}); "
            "rebuild the artifacts with this release",
        )
    if "compiler_version" in data and not _is(data["compiler_version"], "string"):
        bad("compiler_version", f"expected a string, got {_json_type(data['compiler_version'])}")
    if "artifacts" not in data:
        bad("artifacts", "missing")
    artifacts = data["artifacts"]
    if not _is(artifacts, "array"):
        bad("artifacts", f"expected an array, got {_json_type(artifacts)}")
    seen: dict[tuple[str, str], int] = {}
    for i, a in enumerate(artifacts):
        where = f"artifacts[{i}]"
        if not _is(a, "object"):
            bad(where, f"expected an object, got {_json_type(a)}")
        for name, (kind, required) in _ENTRY_FIELDS.items():
            if name not in a:
                if required:
                    bad(f"{where}.{name}", "missing")
                continue
            if not _is(a[name], kind):
                bad(
                    f"{where}.{name}",
                    f"expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {_json_type(a[name])}",
                )
        if not _relative_inside(a["path"]):
            bad(f"{where}.path", f"{a['path']!r} escapes the artifact directory (must be a relative path inside it)")
        if not _HEX64.fullmatch(a["sha256"]):
            bad(f"{where}.sha256", f"{a['sha256']!r} is not a lowercase hex sha256")
        if "flags" in a and not all(isinstance(f, str) for f in a["flags"]):
            bad(f"{where}.flags", "expected an array of strings")
        align = a.get("binding_alignment", DEFAULT_BINDING_ALIGNMENT)
        if align < 1 or align & (align - 1):
            bad(f"{where}.binding_alignment", f"expected a power of two, got {align}")
        key = (a["target"], a["variant"])
        if key in seen:
            # Which of the two would load is arbitrary: build() never writes this.
            bad(f"{where}", f"second entry for {key[0]}/{key[1]} (first: artifacts[{seen[key]}])")
        seen[key] = i


def parse_pins(value) -> frozenset[str] | None:
    """Session(manifest_sha256=...): None, one hex digest, or an iterable of
    them (any one may match, e.g. the old and the new during a rollout)."""
    if value is None:
        return None
    values = [value] if isinstance(value, str) else list(value)
    pins = set()
    for v in values:
        if not isinstance(v, str) or not _HEX64.fullmatch(v.strip().lower()):
            raise ValueError(f"manifest_sha256 must be hex sha256 digests (64 hex digits), got {v!r}")
        pins.add(v.strip().lower())
    if not pins:
        raise ValueError("manifest_sha256 is empty: no manifest could match")
    return frozenset(pins)


def read_manifest(directory: Path, *, pins: frozenset[str] | None = None) -> Manifest | None:
    """The validated manifest of `directory`; None where the directory or
    its manifest does not exist (a session with nothing built there yet),
    unless `pins` requires one. Raises ArtifactError for everything else:
    a directory that is not one, an unreadable manifest, bad JSON, a field
    of the wrong type, an unsupported manifest_version, a digest not pinned."""
    directory = Path(directory)
    path = directory / MANIFEST
    if directory.exists() and not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} is not a directory")
    # lexists: a dangling symlink is a broken directory, not an empty one.
    if not os.path.lexists(path):
        if pins is not None:
            raise ArtifactError(f"{path}: missing, but manifest_sha256 pins its digest")
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read the manifest: {e.strerror or e}") from None
    # One read: the bytes hashed are the bytes parsed.
    digest = hashlib.sha256(raw).hexdigest()
    if pins is not None and digest not in pins:
        raise ArtifactError(
            f"{path}: sha256 {digest} is not a pinned manifest digest ({', '.join(sorted(pins))}); "
            "nothing from this directory was loaded"
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest (not JSON): {e}") from None
    validate(data, path)
    return Manifest(path, digest, data)


def entries_for(manifest: Manifest, target: str, kernel_abi: int, parse):
    """(kernel, entry) for the entries this runtime can load on `target`.
    Entries of other targets, with names this release does not accept (an
    older version's variant rules, e.g. an online kernel since found to be
    wrong) or of another kernel ABI are legitimate leftovers of other builds
    and are skipped: "no artifact" then names the rebuild."""
    for a in manifest.artifacts:
        if a["target"] != target:
            continue
        try:
            kernel = parse(a["variant"])
        except ValueError:
            continue
        if a.get("kernel_abi") != kernel_abi:
            continue
        yield kernel, a


def verify_artifact(directory: Path, entry: dict, runtime_version: str) -> tuple[Path, bytes]:
    """The path and bytes of a manifest entry's vmfb, checked: inside the
    directory (after symlinks), a file, built by `runtime_version`'s
    compiler, with the listed sha256. The bytes returned are the bytes
    hashed, so the file cannot change between the check and the load."""
    base = Path(directory).resolve()
    path = (base / entry["path"]).resolve()
    if base not in path.parents:
        raise ArtifactError(f"manifest path {entry['path']!r} escapes {base}")
    if not path.is_file():
        raise ArtifactError(f"artifact file missing: {path}")
    if entry.get("compiler_version") != runtime_version:
        raise ArtifactError(
            f"{path.name} was built by IREE compiler {entry.get('compiler_version')} "
            f"but the runtime is {runtime_version}; rebuild the artifacts"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"cannot read artifact {path}: {e.strerror or e}") from None
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise ArtifactError(f"sha256 of {path} does not match its manifest entry")
    return path, data


def manifest_digest(directory: Path) -> str | None:
    """sha256 of `directory`'s manifest.json, the value to pin."""
    path = Path(directory) / MANIFEST
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
