"""Every file of a bundle with its size and SHA-256 (the manifest's ``files``): recorded by the
build, checked at load, by ``hexforge verify --files`` and after ``hexforge deploy``'s push.

    build ─record()─▶ manifest.file_records = [{path, bytes, sha256}, ...]: every file of the
                      bundle but manifest.json (which cannot hold its own digest)
    load  ─check_load()─▶ sizes: always (one stat a file: an interrupted copy is short)
                          digests: when asked, and for each file this machine has not verified
                          as it is now (the marker below); a mismatch names the file
    verify --files ─problems()─▶ one line per file missing, short, different or not listed

The marker (``$HEXFORGE_CACHE/verified/<key>.json``, default ``~/.cache/hexforge``; never inside
the bundle, which may be read-only) holds, per verified file, the (size, mtime, ctime, inode,
device) it had when its digest matched. A file copied, replaced or written since has another
ctime or inode (ctime cannot be set back by a copy tool), so it is hashed again; the rest are not.
Its key is the bundle's path and its manifest's digest: a bundle rebuilt in place is new again.
A marker that cannot be written (read-only home) only means the digests are checked every load.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import BundleError
from .manifest import MANIFEST_NAME, FileRecord, Manifest

MARKER_FOLDER = "verified"
HASH_THREADS = 4  # hashlib releases the GIL on large reads: a few files are hashed at once


@dataclass(frozen=True)
class FileProblem:
    path: str
    kind: str  # "missing" | "short" | "long" | "different" | "unlisted"
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.kind}" + (f" ({self.detail})" if self.detail else "")


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def bundle_files(root: Path) -> list[str]:
    """Every regular file under ``root`` as a bundle-relative posix path, sorted; manifest.json
    (and its temp file) left out. Symlinked folders inside the bundle are followed once each
    (load_manifest refuses links that leave it)."""
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a link back to a folder already walked: not a second copy
            dirnames[:] = []
            continue
        seen.add(real)
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp") or not os.path.isfile(root / rel):
                continue
            out.append(rel)
    return sorted(out)


def _digests(root: Path, rels: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda r: sha256_of(root / r), rels), strict=True))


def record(root: Path) -> list[FileRecord]:
    """The file list of the bundle as it is in ``root`` now (the build's last step)."""
    rels = bundle_files(root)
    digests = _digests(root, rels)
    return [FileRecord(path=r, bytes=(root / r).stat().st_size, sha256=digests[r]) for r in rels]


def _size_problem(rec: FileRecord, st: os.stat_result | None) -> FileProblem | None:
    if st is None:
        return FileProblem(rec.path, "missing", f"the manifest records {rec.bytes:,} bytes")
    if st.st_size < rec.bytes:
        return FileProblem(rec.path, "short", f"{st.st_size:,} of {rec.bytes:,} bytes")
    if st.st_size > rec.bytes:
        return FileProblem(rec.path, "long", f"{st.st_size:,} bytes, the manifest records "
                                             f"{rec.bytes:,}")
    return None


def _stat(path: Path) -> os.stat_result | None:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if os.path.isfile(path) else None


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def verified_dir() -> Path:
    """Where the markers live: ``$HEXFORGE_CACHE/verified`` (read when asked, not at import)."""
    root = os.environ.get("HEXFORGE_CACHE") or Path.home() / ".cache" / "hexforge"
    return Path(root) / MARKER_FOLDER


def _marker_path(bundle: Path, markers: Path) -> Path:
    manifest_digest = hashlib.sha256((bundle / MANIFEST_NAME).read_bytes()).hexdigest()
    key = hashlib.sha256(f"{bundle.resolve()}\0{manifest_digest}".encode()).hexdigest()[:32]
    return markers / f"{key}.json"


def _read_marker(path: Path) -> dict[str, list[int]]:
    try:
        files = json.loads(path.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return {}  # none yet, or unreadable: every file is new
    return files if isinstance(files, dict) else {}


def _write_marker(path: Path, bundle: Path, files: dict[str, list[int]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bundle": str(bundle.resolve()), "files": files}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the digests are checked again next time, nothing else changes


def problems(bundle: Path, manifest: Manifest, digests: bool | None = True,
             wanted: Callable[[str], bool] | None = None, unlisted: bool = False,
             markers: Path | None = None) -> list[FileProblem]:
    """What differs between the bundle's files and the manifest's list, one entry per file.

    digests: True every wanted file is hashed; None only those the marker in ``markers`` does not
    vouch for (a clean pass updates it); False sizes alone. wanted: which listed paths count
    (default all). unlisted: files in the bundle the list does not hold count too."""
    if manifest.file_records is None:
        raise BundleError(f"{bundle}'s manifest (schema {manifest.schema_version}) records no "
                          "file list: rebuild the bundle with this hexforge to have its files "
                          "checked")
    records = [r for r in manifest.file_records if wanted is None or wanted(r.path)]
    found: list[FileProblem] = []
    stats: dict[str, os.stat_result] = {}
    for rec in records:
        st = _stat(bundle / rec.path)
        why = _size_problem(rec, st)
        if why:
            found.append(why)
        else:
            stats[rec.path] = st
    marker = None if markers is None else _marker_path(bundle, markers)
    seen = _read_marker(marker) if marker is not None and digests is None else {}
    if digests is not False:
        todo = [r for r in records
                if r.path in stats and seen.get(r.path) != _signature(stats[r.path])]
        got = _digests(bundle, [r.path for r in todo])
        for rec in todo:
            if got[rec.path] != rec.sha256:
                found.append(FileProblem(rec.path, "different", f"SHA-256 {got[rec.path][:16]}…, "
                                         f"the manifest records {rec.sha256[:16]}…"))
        if marker is not None and not found:
            _write_marker(marker, bundle, seen | {p: _signature(st) for p, st in stats.items()})
    if unlisted:
        listed = {r.path for r in manifest.file_records}
        found += [FileProblem(p, "unlisted", "the build did not write it")
                  for p in bundle_files(bundle) if p not in listed]
    return sorted(found, key=lambda p: p.path)


def print_file_check(bundle: Path, as_json: bool = False) -> bool:
    """``hexforge verify BUNDLE --files``: every listed file hashed, files the build did not
    write named too; one line per problem, or one JSON object. -> whether the bundle is intact.
    A clean pass leaves the marker, so the next load does not hash the bundle again."""
    import time

    from .manifest import load_manifest, refuse_symlinks_outside

    t = time.perf_counter()
    manifest = load_manifest(bundle, check_files=False)  # a missing graph is one of the lines
    refuse_symlinks_outside(bundle)  # nothing is read through a link that leaves the bundle
    found = problems(bundle, manifest, True, unlisted=True, markers=verified_dir())
    records = manifest.file_records or []
    total = sum(r.bytes for r in records)
    seconds = time.perf_counter() - t
    if as_json:
        print(json.dumps({"bundle": str(bundle), "files": len(records), "bytes": total,
                          "seconds": round(seconds, 2), "intact": not found,
                          "problems": [{"path": p.path, "kind": p.kind, "detail": p.detail}
                                       for p in found]}))
    else:
        for p in found:
            print(p)
        verdict = (f"{len(found)} of {len(records)} files differ from the manifest" if found
                   else f"all {len(records)} files match the manifest's sizes and SHA-256")
        print(f"{bundle}: {verdict} ({total / 1e9:.2f} GB hashed in {seconds:.1f}s)")
    return not found


def only_folders(keep: set[str], skip: set[str]) -> Callable[[str], bool]:
    """A ``wanted`` predicate: top-level folders in ``skip`` are left out, except any in
    ``keep``; top-level files always count."""
    def wanted(rel: str) -> bool:
        top, sep, _ = rel.partition("/")
        return not sep or top in keep or top not in skip
    return wanted


def for_target(manifest: Manifest, target: str) -> Callable[[str], bool]:
    """The files a load of ``target`` reads: the top-level ones and every folder but the other
    targets', the Genie folders and the build's _work/ (a damaged v79 binary does not stop a cpu
    load; it stops a v79 one)."""
    skip = {n for n in manifest.targets if n != target} | {"_work"}
    skip |= {r.path.split("/")[0] for r in manifest.file_records or []
             if r.path.startswith("genie-")}
    return only_folders({target}, skip)


def check_load(bundle: Path, manifest: Manifest, wanted: Callable[[str], bool] | None,
               digests: bool | None = None, markers: Path | None = None) -> None:
    """The load-time check: sizes always, digests as ``digests`` says (None: files this machine
    has not verified, by the marker in ``markers``, default verified_dir()). A bundle without a
    file list (schema 1) is loaded as before."""
    if manifest.file_records is None:
        return
    found = problems(bundle, manifest, digests, wanted,
                     markers=(markers or verified_dir()) if digests is None else None)
    if not found:
        return
    first = found[0]
    what = {"missing": "is missing", "short": "is truncated or corrupted",
            "long": "is corrupted", "different": "is corrupted"}[first.kind]
    more = f"; {len(found) - 1} more file(s) differ" if len(found) > 1 else ""
    raise BundleError(f"bundle file {first.path} {what} ({first.detail}){more}: copy the bundle "
                      f"again; `hexforge verify {bundle} --files` lists every damaged file")
