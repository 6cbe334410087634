"""scripts/gpu_wheels.sh, what of it runs without the GPU machine: the pieces cut to fit beside the
tree, taken one call at a time and joined again (hashes checked, a corrupt or missing piece
refused), the install from the joined wheels with pip, and the import check's verdicts against
this environment. Small made-up wheels, no network."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_wheels.sh"
HELPER = REPO / "scripts" / "gpu_wheels.py"


@pytest.fixture(scope="module")
def gw():
    spec = importlib.util.spec_from_file_location("gpu_wheels", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_wheel(directory: Path, name: str, version: str, payload: bytes = b"") -> Path:
    """A real (tiny) wheel: module `name` with __version__, and `payload` as data to make it big."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n".encode(), f"{name}/blob.bin": payload,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={hashlib.sha256(data).hexdigest()},{len(data)}\n" for path, data in files.items())
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for p, data in files.items():
            z.writestr(p, data)
        z.writestr(f"{dist}/RECORD", record + f"{dist}/RECORD,,\n")
    return path


def run(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **env})
    if check:
        assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done


@pytest.fixture
def dirs(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {"GPU_WHEELS_DIR": str(wheels), "GPU_PIECES_DIR": str(tmp_path / "pieces"),
           "GPU_PIECES_TMP": str(tmp_path / "there"), "ASYNCRL_GPU_SITE": str(tmp_path / "site")}
    return wheels, tmp_path, env


def test_pieces_carried_one_at_a_time_install_and_import(dirs):
    wheels, tmp, env = dirs
    made = [make_wheel(wheels, "gwtest_alpha", "1.0", os.urandom(30_000)),
            make_wheel(wheels, "gwtest_beta", "2.5", os.urandom(12_000))]
    env["GPU_PIECE_BYTES"] = "8192"
    run("--split", env=env)
    manifest = json.loads((tmp / "pieces" / "manifest.json").read_text())
    n = len(manifest["pieces"])
    assert n >= 5 and all(p["bytes"] == 8192 for p in manifest["pieces"][:-1])
    assert sorted(w["name"] for w in manifest["wheels"]) == sorted(p.name for p in made)
    # the plan: one call a piece, each carrying it and the manifest; the last assembles
    plan = [json.loads(line) for line in run("--plan", env=env).stdout.splitlines()]
    assert [c["call"] for c in plan] == list(range(1, n + 1)) and "--assemble" in plan[-1]["command"]
    assert all(c["carry"][0].endswith(f"piece-{c['call']:02d}") for c in plan)
    for i in range(1, n + 1):  # as on the device: each call has only its own piece
        taken = json.loads(run("--take", str(i), env=env).stdout.splitlines()[-1])
        assert taken["have"] == i and taken["of"] == n
    done = run("--assemble", "gwtest_alpha==1.0", "gwtest_beta==2.5", env=env)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["gwtest_alpha"] == "1.0" and report["gwtest_beta"] == "2.5", done.stderr
    assert (tmp / "site" / "gwtest_alpha" / "blob.bin").read_bytes() == zipfile.ZipFile(made[0]).read(
        "gwtest_alpha/blob.bin")


def test_a_corrupt_or_missing_piece_is_refused(dirs, gw):
    wheels, tmp, env = dirs
    make_wheel(wheels, "gwtest_gamma", "0.1", os.urandom(20_000))
    env["GPU_PIECE_BYTES"] = "6000"
    run("--split", env=env)
    n = len(json.loads((tmp / "pieces" / "manifest.json").read_text())["pieces"])
    run("--take", *map(str, range(1, n)), env=env)  # all but the last
    absent = run("--assemble", env=env, check=False)
    assert absent.returncode != 0 and f"piece-{n:02d}" in absent.stderr
    run("--take", str(n), env=env)
    there = tmp / "there" / "piece-02"
    data = bytearray(there.read_bytes())
    data[100] ^= 0xFF
    there.write_bytes(bytes(data))
    corrupt = run("--assemble", env=env, check=False)
    assert corrupt.returncode != 0 and "piece-02 is corrupt" in corrupt.stderr
    assert not (tmp / "site").exists()  # nothing installed
    # a corrupt piece here is refused when taken
    source = tmp / "pieces" / "piece-01"
    source.write_bytes(b"x" + source.read_bytes()[1:])
    assert "corrupt" in run("--take", "1", env=env, check=False).stderr
    # the whole stream is checked too, not only each piece against a manifest that could lie
    manifest = json.loads((tmp / "there" / "manifest.json").read_text())
    manifest["pieces"][1]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (tmp / "there" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="not the whole"):
        gw.verify(tmp / "there")


def test_pieces_of_another_set_are_not_mixed(dirs):
    wheels, tmp, env = dirs
    make_wheel(wheels, "gwtest_delta", "1.0", os.urandom(9_000))
    env["GPU_PIECE_BYTES"] = "4096"
    run("--split", env=env)
    run("--take", "1", env=env)
    make_wheel(wheels, "gwtest_epsilon", "1.0", os.urandom(9_000))
    run("--split", env=env)  # a new fetch: another whole
    stale = run("--take", "2", env=env, check=False)
    assert stale.returncode != 0 and "another set" in stale.stderr


def test_a_piece_is_what_the_call_limit_leaves_beside_the_tree(dirs, gw):
    wheels, tmp, env = dirs
    make_wheel(wheels, "gwtest_zeta", "1.0", os.urandom(5_000))
    tree = int(subprocess.run(["bash", "-c", "source <(sed -n '/^tree_bytes()/,/^}/p' scripts/gpu_wheels.sh); "
                                             "tree_bytes"], cwd=REPO, capture_output=True, text=True).stdout)
    assert tree > 1_000_000  # the tracked tree (the recipes' models)
    env.update(GPU_CALL_LIMIT=str(tree + 100_000 + 3000), GPU_WHEELS_MARGIN="100000")
    run("--split", env=env)
    manifest = json.loads((tmp / "pieces" / "manifest.json").read_text())
    # the tree may have changed by a few bytes between the two measures (another test's files)
    assert abs(manifest["piece_bytes"] - 3000) < 1000 and manifest["tree_bytes"] + manifest["margin_bytes"] + \
        manifest["piece_bytes"] == manifest["call_limit_bytes"]
    env["GPU_CALL_LIMIT"] = str(tree)  # no room left
    refused = run("--split", env=env, check=False)
    assert refused.returncode != 0 and "no room" in refused.stderr


def test_import_verdicts_against_this_environment(gw):
    import omegaconf

    # present at the wanted version; present without a version (stdlib: "ok"); absent; present at another
    result = gw.check([f"omegaconf=={omegaconf.__version__}", "textwrap", "gwtest_no_such_module",
                       "pytest==0.0.1"])
    assert result["omegaconf"] == omegaconf.__version__ and result["textwrap"] == "ok"
    assert result["gwtest_no_such_module"].startswith("missing: ModuleNotFoundError")
    assert result["pytest"] == f"wrong version: {pytest.__version__} (want 0.0.1)"
    assert result["failed"] == ["gwtest_no_such_module", "pytest"] and result["ok"] is False
    assert gw.check([f"omegaconf=={omegaconf.__version__}", "textwrap"])["ok"] is True
    # the script's own line and exit status
    for specs, rc in ((["textwrap", "gwtest_no_such_module"], 1), (["textwrap"], 0)):
        done = subprocess.run([sys.executable, str(HELPER), "check", *specs], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == rc and json.loads(done.stdout)["ok"] is (rc == 0)


def test_verdict_rules(gw):
    assert gw.verdict("torch==2.11.0", {"module": "torch", "version": "2.11.0+cu130"}) == ("2.11.0+cu130", True)
    assert gw.verdict("vllm==0.26.0", {"module": "vllm", "version": "0.32.0+cpu"})[1] is False
    assert gw.verdict("vllm==0.26.0", {"module": "vllm", "version": None})[1] is False
    assert gw.verdict("asyncrl", {"module": "asyncrl", "version": None}) == ("ok", True)
    assert gw.verdict("x", {"module": "x", "failure": "error: ImportError: y"}) == ("error: ImportError: y", False)
    assert gw.verdict("x", None)[1] is False  # the probe died before it: never a pass
    assert set(gw.DEFAULT_CHECKS) >= {"vllm==0.26.0", "ray==2.60.0", "megatron.core==0.16.1", "asyncrl"}


def test_what_to_carry_is_what_the_machine_lacks(gw, tmp_path):
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in
                          [("vllm", "0.26.0"), ("NumPy", "2.3.5"), ("torch", "2.11.0"), ("Tile_Lang", "0.1.9"),
                           ("ray", "2.60.0")]]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    (tmp_path / "present.txt").write_text("# the machine's\nnumpy\ntorch\n")
    assert gw.missing(tmp_path / "report.json", tmp_path / "present.txt", "tile-lang other") == \
        ["ray==2.60.0", "vllm==0.26.0"]
    # the machine's list holds what the issue says is there
    present = (REPO / "scripts" / "gpu_machine_packages.txt").read_text().split()
    assert {"torch", "triton", "numpy", "numba", "transformers", "cupy-cuda13x"} <= set(present)


def test_slim_drops_members_and_their_record_lines(gw, tmp_path):
    wheel = make_wheel(tmp_path, "gwtest_eta", "1.0", b"k" * 1000)
    out = gw.slim(wheel, ["gwtest_eta/blob.bin"])
    assert out["dropped"] == ["gwtest_eta/blob.bin"]
    with zipfile.ZipFile(wheel) as z:
        assert "gwtest_eta/blob.bin" not in z.namelist()
        assert "blob.bin" not in z.read("gwtest_eta-1.0.dist-info/RECORD").decode()
        assert z.read("gwtest_eta/__init__.py").startswith(b"__version__")


def test_split_slim_cuts_the_listed_members_into_a_copy(dirs):
    wheels, tmp, env = dirs
    for name, version, members in (("vllm", "0.26.0", ["vllm/vllm-rs", "vllm/keep.py"]),
                                   ("ray", "2.60.0", ["ray/jars/ray_dist.jar", "ray/keep.py"])):
        path = wheels / f"{name}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            for member in members:
                z.writestr(member, b"x" * 100)
            z.writestr(f"{name}-{version}.dist-info/RECORD", "".join(f"{m},,\n" for m in members))
    make_wheel(wheels, "gwtest_theta", "1.0")
    env["GPU_PIECE_BYTES"] = "100000"
    run("--split", "--slim", env=env)
    slim = Path(str(wheels) + "-slim")
    assert sorted(p.name for p in slim.glob("*.whl")) == sorted(p.name for p in wheels.glob("*.whl"))
    assert zipfile.ZipFile(slim / "vllm-0.26.0-py3-none-any.whl").namelist() == [
        "vllm/keep.py", "vllm-0.26.0.dist-info/RECORD"]
    assert "ray/jars/ray_dist.jar" not in zipfile.ZipFile(slim / "ray-2.60.0-py3-none-any.whl").namelist()
    assert "vllm/vllm-rs" in zipfile.ZipFile(wheels / "vllm-0.26.0-py3-none-any.whl").namelist()  # untouched
    manifest = json.loads((tmp / "pieces" / "manifest.json").read_text())
    assert manifest["wheels_dir"] == str(slim) and len(manifest["wheels"]) == 3
