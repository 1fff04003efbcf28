"""The model's identity in a key's namespace: which weights (and adapters) wrote an object, and
what its frame proves.

A persistent store outlives the engine, so the model's path or name is not enough: a checkpoint
updated in place (same path, same geometry, new weights) would meet the objects of its old
weights. Every key namespace (the ``Linker``'s seed, the SGLang plugin's and the vLLM
connector's) is therefore built from :func:`namespace_term`, which folds in

* the model's name as given (path or hub name);
* a fingerprint of its checkpoint (:func:`checkpoint_fingerprint`), computed once at start-up
  without reading the weights: every file's relative name and size, the content of its small
  ``*.json`` files (``config.json``, ``*.safetensors.index.json``, ...), and a sample of
  :data:`SAMPLES` reads of :data:`SAMPLE_BYTES` spread over each other file (a retrain that
  keeps every size still changes the sampled bytes in practice; a change the samples miss is
  what ``model_revision`` is for);
* the operator's ``model_revision`` (optional: bump it to retire every stored object of the
  model without touching the files);
* the adapters' digests (:func:`directory_digest`: every byte of each adapter's files);
* the integrity level (``"checksum"`` / ``"header"``): engines at different levels never read
  each other's objects;
* :data:`NAMESPACE_VERSION`, bumped whenever this rule changes (every stored object is then a
  miss: keys of an older rule are never produced again).

Where the model is not a local directory (a hub name), :func:`resolve_checkpoint` looks for it
in the Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``): the snapshot of ``model_revision`` if that names one, else of the
ref ``main``. Found: the snapshot is fingerprinted like a directory. Not found: the identity is
the name and ``model_revision`` alone (logged as a warning) — an update in place is then not
seen unless ``model_revision`` changes.

This module reads files (once per process, at start-up): the one part of ``components`` that
does I/O.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

log = logging.getLogger(__name__)

#: bumped whenever the namespace rule changes; part of every namespace
NAMESPACE_VERSION = 2
#: ``*.json`` files up to this size are digested whole (configs, safetensors indexes)
SMALL_FILE_BYTES = 1 << 20
#: reads of SAMPLE_BYTES spread evenly over each other file (never the whole weights)
SAMPLES = 16
SAMPLE_BYTES = 4096


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + len(value).to_bytes(8, "little") + value


def _files(root: Path) -> Iterator[tuple[str, Path]]:
    """Every file under ``root`` (symlinks followed, as a hub snapshot's are) by relative name,
    sorted; hidden entries (``.cache/``, ``.gitattributes``: download metadata) are left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return iter(sorted(found))


def checkpoint_fingerprint(root: Path | str) -> bytes:
    """SHA-256 of a checkpoint directory without reading its weights: each file's name and size,
    small ``*.json`` files whole, :data:`SAMPLES` spread reads of every other file. Raises
    ``OSError`` where ``root`` cannot be read."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{str(root)!r} is not a directory")
    h = hashlib.sha256(b"hylinker-checkpoint")
    for rel, path in _files(root):
        size = path.stat().st_size
        h.update(_field(b"file", rel.encode()) + size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            if rel.endswith(".json") and size <= SMALL_FILE_BYTES:
                h.update(_field(b"content", f.read()))
                continue
            step = max(1, size // SAMPLES)
            for offset in sorted({min(i * step, max(0, size - SAMPLE_BYTES)) for i in range(SAMPLES)}):
                f.seek(offset)
                h.update(_field(b"sample", f.read(SAMPLE_BYTES)))
    return h.digest()


def directory_digest(root: Path | str) -> bytes:
    """SHA-256 over every file of a (small) directory, such as a LoRA adapter's: relative names,
    sizes and whole contents. Raises ``OSError`` (``NotADirectoryError`` where ``root`` is not a
    directory)."""
    root = Path(root)
    if not str(root) or not root.is_dir():
        raise NotADirectoryError(f"{str(root)!r} is not a local directory")
    h = hashlib.sha256()
    for rel, path in _files(root):
        name = rel.encode()
        h.update(len(name).to_bytes(8, "little") + name + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.digest()


def hub_cache() -> Path:
    """Where the Hugging Face hub keeps its downloads (the hub's own environment variables)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_checkpoint(name: str, revision: str = "", *, cache: Path | None = None) -> tuple[Path | None, str]:
    """The directory holding ``name``'s files and how it was found: ``"directory"`` (a local
    path), ``"hub cache"`` (a snapshot of the hub cache: ``revision`` if it names a snapshot or
    a ref, else ``main``) or ``"name"`` (neither: ``None``)."""
    if name and Path(name).is_dir():
        return Path(name), "directory"
    if not name or name.count("/") != 1:
        return None, "name"
    repo = (cache or hub_cache()) / ("models--" + name.replace("/", "--"))
    if revision and (repo / "snapshots" / revision).is_dir():
        return repo / "snapshots" / revision, "hub cache"
    try:
        commit = (repo / "refs" / (revision or "main")).read_text().strip()
    except (OSError, ValueError):
        return None, "name"
    snapshot = repo / "snapshots" / commit
    return (snapshot, "hub cache") if commit and snapshot.is_dir() else (None, "name")


@attrs.frozen
class ModelIdentity:
    """Which weights a deployment serves: its name, its checkpoint's fingerprint (``b""`` where
    none was found), the operator's revision, and where the files were found."""

    name: str
    weights: bytes
    revision: str = ""
    source: str = "name"  # "directory" | "hub cache" | "name"
    path: str = ""

    def term(self) -> bytes:
        """What the identity adds to a namespace (32 bytes)."""
        h = hashlib.sha256(b"hylinker-model")
        h.update(_field(b"name", self.name.encode()) + _field(b"weights", self.weights)
                 + _field(b"revision", self.revision.encode()))
        return h.digest()

    def describe(self) -> str:
        """One line for the start-up log."""
        rev = f", model_revision {self.revision!r}" if self.revision else ""
        if self.source == "name":
            return f"model {self.name!r}: no local files (name{rev} only)"
        return f"model {self.name!r}: {self.source} {self.path}, weights {self.weights.hex()[:16]}{rev}"


def model_identity(name: str, revision: str = "", *, cache: Path | None = None) -> ModelIdentity:
    """The identity of the model ``name`` (a local checkpoint directory or a hub name) at
    ``revision`` (``model_revision``; ``""``: none), fingerprinted once. A name whose files are
    not found is identified by name and revision alone, with a warning."""
    if not isinstance(name, str) or not isinstance(revision, str):
        raise TypeError(f"model name and revision must be str, got {type(name).__name__}, "
                        f"{type(revision).__name__}")
    path, source = resolve_checkpoint(name, revision, cache=cache)
    if path is None:
        ident = ModelIdentity(name, b"", revision, "name")
        if not name:  # a library deployment that names no model: nothing to warn about
            return ident
        log.warning("hylinker: %s; an update in place is not seen unless model_revision changes",
                    ident.describe())
        return ident
    ident = ModelIdentity(name, checkpoint_fingerprint(path), revision, source, str(path))
    log.info("hylinker: %s", ident.describe())
    return ident


def adapters_term(adapters: Sequence[tuple[str, str]], *, cache: Path | None = None) -> bytes:
    """What a set of ``(name, path)`` adapters adds to a namespace: each one's name, path and
    :func:`directory_digest` (an adapter not found locally or in the hub cache: name and path
    only, with a warning). ``b""`` for none."""
    if not adapters:
        return b""
    h = hashlib.sha256(b"hylinker-adapters")
    for name, path in sorted(adapters):
        where, _ = resolve_checkpoint(path, cache=cache)
        digest = b""
        if where is None:
            log.warning("hylinker: LoRA adapter %r: %r is not a local directory nor in the hub cache; "
                        "keyed by name and path only", name, path)
        else:
            digest = directory_digest(where)
        h.update(_field(b"name", name.encode()) + _field(b"path", path.encode()) + _field(b"digest", digest))
    return h.digest()


def namespace_term(model: ModelIdentity, integrity: str, adapters: bytes = b"") -> bytes:
    """The one rule every key namespace folds in (32 bytes): :data:`NAMESPACE_VERSION`, the
    model's identity, the integrity level (``"checksum"``/``"header"``) and the adapters' term."""
    h = hashlib.sha256(b"hylinker-namespace")
    h.update(NAMESPACE_VERSION.to_bytes(4, "little") + _field(b"model", model.term())
             + _field(b"integrity", integrity.encode()) + _field(b"adapters", adapters))
    return h.digest()


__all__ = ["NAMESPACE_VERSION", "ModelIdentity", "adapters_term", "checkpoint_fingerprint", "directory_digest",
           "hub_cache", "model_identity", "namespace_term", "resolve_checkpoint"]
