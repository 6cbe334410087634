"""The wheels a bare GPU machine lacks, carried to it in pieces (scripts/gpu_wheels.sh, docs/gpu.md).

The lent GPU machine takes at most 64 MiB of files a command, the tracked tree included, and
keeps what a command wrote under /tmp while it is held. So the wheel set (~460 MiB) travels as a
tar stream cut into numbered pieces, each small enough to ride beside the tree; one command a
piece copies it to /tmp; a last one checks every hash, joins them, unpacks the wheels, and (the
shell script) installs them and checks the imports.

    python scripts/gpu_wheels.py missing REPORT PRESENT LEAVE_OUT   # pip's --report -> NAME==VERSION lines
    python scripts/gpu_wheels.py split WHEELS PIECES PIECE_BYTES    # tar of WHEELS/*.whl -> PIECES/piece-NN + manifest
    python scripts/gpu_wheels.py take PIECES DEST N [N ...]         # copy piece N (and the manifest) to DEST, verified
    python scripts/gpu_wheels.py assemble DEST OUT                  # every piece verified, joined, OUT/*.whl unpacked
    python scripts/gpu_wheels.py plan PIECES                        # the device calls, in order
    python scripts/gpu_wheels.py check [MODULE[==VERSION] ...]      # a JSON line of import verdicts (1: one failed)
    python scripts/gpu_wheels.py slim WHEEL MEMBER [MEMBER ...]     # rewrite a wheel without MEMBERs (RECORD too)

Standard library only: it runs on the GPU machine before anything is installed there.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 20

# What the GPU run needs to import, and the version each must be (None: any).
DEFAULT_CHECKS = [
    # the FlashAttention-3 kernels vLLM takes on Hopper: they load (CUDA 13) with the machine's torch
    "torch==2.11.0", "vllm==0.26.0", "vllm.vllm_flash_attn._vllm_fa3_C", "vllm.v1.engine.async_llm",
    "flashinfer==0.6.14", "ray==2.60.0",
    "megatron.core==0.16.1", "mbridge==0.15.1", "hydra==1.3.8", "omegaconf==2.3.1", "reasoning_gym",
    "cupy", "asyncrl", "asyncrl.train",
]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def piece_name(n: int) -> str:
    return f"piece-{n:02d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


# -- here: which wheels ------------------------------------------------------------------------


def missing(report: Path, present: Path, leave_out: str) -> list[str]:
    """NAME==VERSION of each distribution pip's resolution (`pip install --dry-run --report`)
    would install, less those the GPU machine has (`present`: one name a line) and those left out
    (`leave_out`: names separated by spaces)."""
    have = {normalize(line.split("#")[0].strip()) for line in present.read_text().splitlines()}
    have |= {normalize(n) for n in leave_out.split()}
    have.discard("")
    out = []
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        if normalize(meta["name"]) not in have:
            out.append(f"{normalize(meta['name'])}=={meta['version']}")
    return sorted(out)


def slim(wheel: Path, members: list[str]) -> dict:
    """Rewrite `wheel` in place without `members` (paths inside it), their RECORD lines too, so
    that pip installs the rest as usual. Returns what was dropped and the sizes."""
    before = wheel.stat().st_size
    tmp = wheel.with_name(wheel.name + ".slim")
    dropped = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in members:
                dropped.append(info.filename)
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] not in members]
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                data = buf.getvalue().encode()
            dst.writestr(info, data, compress_type=info.compress_type)
    tmp.replace(wheel)
    return {"wheel": wheel.name, "dropped": dropped, "bytes_before": before, "bytes_after": wheel.stat().st_size}


# -- here: the pieces --------------------------------------------------------------------------


class _PieceWriter(io.RawIOBase):
    """A write-only stream cut into files of `piece_bytes`, hashing each and the whole."""

    def __init__(self, pieces: Path, piece_bytes: int):
        self.dir, self.limit = pieces, piece_bytes
        self.whole = hashlib.sha256()
        self.size = 0
        self.done: list[dict] = []
        self._f = None
        self._h = None
        self._n = 0

    def writable(self) -> bool:
        return True

    def _close_piece(self) -> None:
        if self._f is not None:
            self._f.close()
            self.done.append({"name": piece_name(len(self.done) + 1), "bytes": self._n, "sha256": self._h.hexdigest()})
            self._f = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while len(view):
            if self._f is None:
                self._f = open(self.dir / piece_name(len(self.done) + 1), "wb")
                self._h, self._n = hashlib.sha256(), 0
            take = min(len(view), self.limit - self._n)
            self._f.write(view[:take])
            self._h.update(view[:take])
            self.whole.update(view[:take])
            self._n += take
            self.size += take
            view = view[take:]
            if self._n == self.limit:
                self._close_piece()
        return total

    def close(self) -> None:
        self._close_piece()
        super().close()


def split(wheels: Path, pieces: Path, piece_bytes: int, extra: dict | None = None) -> dict:
    """A tar of every `wheels/*.whl` (sorted, no owners or dates: the same wheels give the same
    bytes), cut into `pieces/piece-NN` of `piece_bytes` (the last shorter), and
    `pieces/manifest.json`: each piece's size and sha256, the whole stream's, and each wheel's."""
    if piece_bytes <= 0:
        raise SystemExit(f"gpu_wheels: piece size {piece_bytes} bytes: the tree leaves no room for a piece")
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise SystemExit(f"gpu_wheels: no wheels in {wheels}")
    pieces.mkdir(parents=True, exist_ok=True)
    for old in list(pieces.glob("piece-*")) + [pieces / MANIFEST]:
        old.unlink(missing_ok=True)
    writer = _PieceWriter(pieces, piece_bytes)
    listed = []
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with open(path, "rb") as f:
                tar.addfile(info, f)
            listed.append({"name": path.name, "bytes": info.size, "sha256": sha256_file(path)})
    writer.close()
    manifest = {
        "format": "tar of wheels, cut into pieces (scripts/gpu_wheels.py)",
        "piece_bytes": piece_bytes,
        "pieces": writer.done,
        "whole": {"bytes": writer.size, "sha256": writer.whole.hexdigest()},
        "wheels": listed,
        **(extra or {}),
    }
    (pieces / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def plan(pieces: Path) -> list[str]:
    """The device calls that carry the pieces and install them, in order."""
    manifest = json.loads((pieces / MANIFEST).read_text())
    rel = os.path.relpath(pieces, Path.cwd())
    n = len(manifest["pieces"])
    lines = []
    for i in range(1, n + 1):
        command = f"bash scripts/gpu_wheels.sh --take {i}"
        if i == n:
            command += " && bash scripts/gpu_wheels.sh --assemble"
        lines.append(json.dumps({"call": i, "carry": [f"{rel}/{piece_name(i)}", f"{rel}/{MANIFEST}"],
                                 "command": command, "timeout_s": 300 if i == n else 60}))
    return lines


# -- there: take, assemble ---------------------------------------------------------------------


def _load_manifest(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"gpu_wheels: no readable manifest at {path} ({e})") from None


def take(pieces: Path, dest: Path, numbers: list[int]) -> list[str]:
    """Copy each piece N (and the manifest) from `pieces` into `dest`, each checked against the
    manifest; a manifest already in `dest` from another set of pieces is refused."""
    manifest = _load_manifest(pieces / MANIFEST)
    dest.mkdir(parents=True, exist_ok=True)
    kept = dest / MANIFEST
    if kept.exists() and _load_manifest(kept)["whole"] != manifest["whole"]:
        raise SystemExit(f"gpu_wheels: {dest} holds pieces of another set (its manifest differs): "
                         f"remove {dest} or take every piece of this set")
    shutil.copyfile(pieces / MANIFEST, kept)
    done = []
    for n in numbers:
        if not 1 <= n <= len(manifest["pieces"]):
            raise SystemExit(f"gpu_wheels: no piece {n}: the set has {len(manifest['pieces'])}")
        want = manifest["pieces"][n - 1]
        src = pieces / want["name"]
        if not src.exists():
            raise SystemExit(f"gpu_wheels: {src} is not here (carry it with this command)")
        got = sha256_file(src)
        if got != want["sha256"]:
            raise SystemExit(f"gpu_wheels: {src} is corrupt (sha256 {got[:12]}, manifest {want['sha256'][:12]})")
        shutil.copyfile(src, dest / (want["name"] + ".part"))
        (dest / (want["name"] + ".part")).replace(dest / want["name"])
        done.append(want["name"])
    have = [p["name"] for p in manifest["pieces"] if (dest / p["name"]).exists()]
    print(json.dumps({"took": done, "have": len(have), "of": len(manifest["pieces"]),
                      "still_missing": [p["name"] for p in manifest["pieces"] if p["name"] not in have]}))
    return done


class _Joined(io.RawIOBase):
    """The pieces read back to back as one stream."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self.f = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            if self.f is None:
                if not self.paths:
                    return 0
                self.f = open(self.paths.pop(0), "rb")
            n = self.f.readinto(buf)
            if n:
                return n
            self.f.close()
            self.f = None


def verify(dest: Path) -> dict:
    """Every piece the manifest in `dest` lists is there with its size and hash, and together
    they are the whole stream; raises SystemExit naming what is wrong."""
    manifest = _load_manifest(dest / MANIFEST)
    absent = [p["name"] for p in manifest["pieces"] if not (dest / p["name"]).exists()]
    if absent:
        raise SystemExit(f"gpu_wheels: pieces missing in {dest}: {' '.join(absent)}")
    whole, size = hashlib.sha256(), 0
    for p in manifest["pieces"]:
        h = hashlib.sha256()
        with open(dest / p["name"], "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
                whole.update(block)
                size += len(block)
        if h.hexdigest() != p["sha256"]:
            raise SystemExit(f"gpu_wheels: {dest / p['name']} is corrupt (sha256 {h.hexdigest()[:12]}, "
                             f"manifest {p['sha256'][:12]}): take it again")
    if size != manifest["whole"]["bytes"] or whole.hexdigest() != manifest["whole"]["sha256"]:
        raise SystemExit("gpu_wheels: the joined pieces are not the whole the manifest names")
    return manifest


def assemble(dest: Path, out: Path) -> list[Path]:
    """verify(dest), then unpack the wheels into `out` (emptied first), each checked against the
    manifest. Returns their paths."""
    manifest = verify(dest)
    want = {w["name"]: w for w in manifest["wheels"]}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tarfile.open(fileobj=io.BufferedReader(_Joined([dest / p["name"] for p in manifest["pieces"]]), CHUNK),
                      mode="r|") as tar:
        for member in tar:
            if not member.isfile() or member.name not in want or "/" in member.name:
                raise SystemExit(f"gpu_wheels: unexpected entry in the pieces: {member.name!r}")
            src = tar.extractfile(member)
            with open(out / member.name, "wb") as f:
                shutil.copyfileobj(src, f, CHUNK)
    paths = sorted(out.glob("*.whl"))
    for path in paths:
        w = want[path.name]
        if path.stat().st_size != w["bytes"] or sha256_file(path) != w["sha256"]:
            raise SystemExit(f"gpu_wheels: {path.name} unpacked wrong")
    if len(paths) != len(want):
        raise SystemExit(f"gpu_wheels: {len(paths)} wheels unpacked, the manifest lists {len(want)}")
    return paths


# -- there: the import check -------------------------------------------------------------------

_PROBE = r"""
import importlib, importlib.metadata, json, sys
for spec in sys.argv[1:]:
    module = spec.split("==")[0]
    try:
        mod = importlib.import_module(module)
        version = getattr(mod, "__version__", None)
        if not isinstance(version, str):
            top = module.split(".")[0]
            dists = importlib.metadata.packages_distributions().get(top, [])
            version = importlib.metadata.version(dists[0]) if dists else None
        print("PROBE" + json.dumps({"module": module, "version": version}), flush=True)
    except BaseException as e:
        kind = "missing" if isinstance(e, ModuleNotFoundError) else "error"
        print("PROBE" + json.dumps({"module": module, "failure": f"{kind}: {type(e).__name__}: {e}"[:300]}),
              flush=True)
"""


def verdict(spec: str, probe: dict | None) -> tuple[str, bool]:
    """(what to print for `spec`, whether it holds) from the probe's record of it (None: the
    probe died before it)."""
    module, _, want = spec.partition("==")
    if probe is None:
        return "not run: the import check's process died before it", False
    if "failure" in probe:
        return probe["failure"], False
    got = probe.get("version")
    if not want:
        return got or "ok", True
    if got is not None and (got == want or got.startswith(want + "+")):
        return got, True
    return f"wrong version: {got} (want {want})", False


def check(specs: list[str], timeout_s: float = 600) -> dict:
    """Import each `module[==version]` in a fresh interpreter, one after another; a verdict for
    each, and ok only if every one holds."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, *specs], capture_output=True, text=True,
                              timeout=timeout_s)
        out, rc = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    probes = {}
    for line in out.splitlines():
        if line.startswith("PROBE"):
            record = json.loads(line[len("PROBE"):])
            probes[record["module"]] = record
    result: dict = {"check": "gpu_wheels"}
    failed = []
    for spec in specs:
        module = spec.split("==")[0]
        text, ok = verdict(spec, probes.get(module))
        result[module] = text
        if not ok:
            failed.append(module)
    if rc != 0 and len(probes) == len(specs):
        failed.append(f"exit status {rc}")
    result["failed"] = failed
    result["ok"] = not failed
    return result


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    command, args = argv[0], argv[1:]
    if command == "missing":
        print("\n".join(missing(Path(args[0]), Path(args[1]), " ".join(args[2:]))))
    elif command == "split":
        extra = json.loads(os.environ["GPU_WHEELS_MANIFEST_EXTRA"]) if os.environ.get("GPU_WHEELS_MANIFEST_EXTRA") \
            else None
        m = split(Path(args[0]), Path(args[1]), int(args[2]), extra)
        print(json.dumps({"pieces": len(m["pieces"]), "piece_bytes": m["piece_bytes"], "wheels": len(m["wheels"]),
                          "bytes": m["whole"]["bytes"], "sha256": m["whole"]["sha256"]}))
    elif command == "take":
        take(Path(args[0]), Path(args[1]), [int(a) for a in args[2:]])
    elif command == "assemble":
        paths = assemble(Path(args[0]), Path(args[1]))
        print(json.dumps({"assembled": len(paths), "dir": args[1]}))
    elif command == "plan":
        print("\n".join(plan(Path(args[0]))))
    elif command == "check":
        result = check(args or DEFAULT_CHECKS)
        print(json.dumps(result), flush=True)
        return 0 if result["ok"] else 1
    elif command == "slim":
        print(json.dumps(slim(Path(args[0]), args[1:])))
    else:
        print(f"gpu_wheels.py: unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
