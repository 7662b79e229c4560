"""Build the folder that takes chattune's GPU check to a GPU machine without internet, in one call.

    python scripts/gpu_carry.py                        # builds .gpu-carry/, prints the carry list and the command
    python scripts/gpu_carry.py --with-bitsandbytes    # also .gpu-carry-bnb/ (the QLoRA rows: a second call)

Run it where a package registry is reachable. The folder (git-ignored, default `.gpu-carry/` in the repo root):
- `wheels/`: what the GPU machine (Python 3.12, x86_64, torch 2.11 and transformers 5.17 preinstalled; no
  internet) lacks, for Python 3.12 manylinux x86_64 (`PACKAGES`, pinned as the project's venv and the earlier
  hand-built kit): hydra-core, omegaconf, antlr4-python3-runtime (built here from its sdist), torchdata,
  datasets with dill and multiprocess, peft (ours, over the machine's), trl (the comparison rows),
  cut-cross-entropy, torchao (float8, low-bit optimizer states) and fla (the hybrid kernels). Not carried: what the machine has (pyarrow, pandas, xxhash,
  fsspec, huggingface-hub, accelerate...); `run.sh` checks those and names what is missing or too old
  (`--extra NAME==VERSION` adds a wheel). bitsandbytes (43 MB) goes in a folder of its own.
- `assets.tar.gz`: the files of ../shared/assets that scripts/gpu_check and scripts/bench/bench_gpu.py read
  (`ASSETS`: the Qwen3 tokenizer, the FastChat chats, the long deita chats), which are not in the project.
- `project.tar.gz`: the project, for a machine not given the checkout: by default the working tree as the
  device tool sends it (tracked and untracked-not-ignored files), `--archive head` for `git archive HEAD`.
- `run.sh` (scripts/gpu_carry_run.sh), this script (its environment check and summary) and MANIFEST.json.

The folder (and the working tree sent beside it) must stay under 64 MiB: the build fails otherwise. It prints
the `carry` list and the one command (at most 2,000 characters) to give the device tool, e.g.
`bash .gpu-carry/run.sh --results "$OUT" --budget 540`: install, environment check, gpu_check and
bench_gpu.py in their shares of the budget, a summary, and the second command for what did not fit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
CARRY_LIMIT = 64 * MIB  # the device tool's limit on what travels: the working tree and the carried paths together
COMMAND_LIMIT = 2000  # characters in the device tool's one command
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The wheels of the first call: name, version, why. Versions: the project's venv (pip list), else the earlier
# kit's (trl 1.16.0 as in BENCHMARKS.md's TRL rows), else the newest on the registry (fla).
PACKAGES = [
    ("hydra-core", "1.3.8", "the recipes' configs"),
    ("omegaconf", "2.3.1", "the recipes' configs"),
    ("antlr4-python3-runtime", "4.9.3", "omegaconf's parser (sdist only: built here)"),
    ("torchdata", "0.11.0", "StatefulDataLoader"),
    ("datasets", "5.2.0", "the data pipeline"),
    ("dill", "0.4.1", "datasets"),
    ("multiprocess", "0.70.19", "datasets"),
    ("peft", "0.21.2", "LoRA (ours over the machine's, of unknown version)"),
    ("trl", "1.16.0", "the TRL comparison rows"),
    ("cut-cross-entropy", "25.1.1", "the fused output-layer loss"),
    ("torchao", "0.18.0", "float8 linear layers and low-bit optimizer states (Python; its C kernels are optional)"),
    ("pytest", "9.2.0", "gpu_check's cuda_tests row (the CUDA-only tests)"),
    ("pluggy", "1.7.0", "pytest's"),
    ("iniconfig", "2.3.1", "pytest's"),
    ("pygments", "2.21.0", "pytest 9's"),
    ("fla-core", "0.6.0", "the hybrid models' kernels (pure Python, Triton)"),
    ("flash-linear-attention", "0.6.0", "the hybrid models' kernels (pure Python, Triton)"),
]
SDIST_ONLY = {"antlr4-python3-runtime"}
BITSANDBYTES = ("bitsandbytes", "0.50.2", "QLoRA's 4-bit base (43 MB: a folder and a call of its own)")
# What gpu_check and bench_gpu.py read under --assets (make_corpora, make_model, gpu_check's tokenizer).
ASSETS = [
    "tokenizers/qwen3/tokenizer.json",
    "tokenizers/qwen3/tokenizer_config.json",
    "data/sharegpt_fastchat_dummy.json",
    "data/messages_deita_long.parquet",
]
# run.sh imports these on the machine, after the install (module, required, what provides it).
IMPORTS = [
    ("torch", True, "the machine"),
    ("transformers", True, "the machine"),
    ("tokenizers", True, "the machine"),
    ("safetensors", True, "the machine"),
    ("numpy", True, "the machine"),
    ("jinja2", True, "the machine"),
    ("yaml", True, "the machine (pyyaml)"),
    ("tqdm", True, "the machine"),
    ("pyarrow", True, "the machine"),
    ("pandas", True, "the machine"),
    ("hydra", True, "hydra-core"),
    ("omegaconf", True, "omegaconf"),
    ("antlr4", True, "antlr4-python3-runtime"),
    ("torchdata.stateful_dataloader", True, "torchdata"),
    ("datasets", True, "datasets"),
    ("peft", True, "peft"),
    ("chattune.cli.main", True, "the project"),
    ("cut_cross_entropy", False, "cut-cross-entropy"),
    ("torchao", False, "torchao"),
    ("trl", False, "trl"),
    ("fla", False, "fla-core"),
    ("pytest", False, "pytest"),
    ("bitsandbytes", False, "bitsandbytes (--with-bitsandbytes)"),
    ("flash_attn", False, "not carried"),
]
MINIMUM = {"python": (3, 10), "torch": (2, 11), "transformers": (5, 17)}  # pyproject.toml's floors
DEFAULT_BUDGET = 540  # seconds: the device tool's 10-minute command, less the machine's start-up slack


class BuildError(RuntimeError):
    pass


class RegistryError(BuildError):
    """pip could not reach the package registry."""


# --- the build (a machine with a registry) ---


def run_pip(args: list[str], what: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode:
        output = done.stderr + done.stdout
        error = "\n".join(line for line in output.splitlines() if "WARNING" not in line)
        unreachable = re.search(
            r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
            r"Connection refused|Network is unreachable|ProxyError|timed out",
            output,
        )
        raise (RegistryError if unreachable else BuildError)(f"{what} failed:\n{error[-2000:]}")


def download_args(directory: Path) -> list[str]:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(directory),
    ]


def fetch_wheels(directory: Path, packages: list[tuple[str, str, str]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    binary = [f"{name}=={version}" for name, version, _ in packages if name not in SDIST_ONLY]
    if binary:
        run_pip(download_args(directory) + binary, "pip download " + " ".join(binary))
    for name, version, _ in packages:
        if name in SDIST_ONLY:  # a pure-Python sdist: its wheel is the same for every Python 3
            run_pip(["wheel", "-q", "--no-deps", "-w", str(directory), f"{name}=={version}"], f"pip wheel {name}")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_tags(filename: str) -> tuple[str, str, list[str], list[str], list[str]]:
    """name, version, python tags, abi tags, platform tags of a wheel's file name (PEP 427)."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise BuildError(f"not a wheel file name: {filename}")
    return parts[0], parts[1], parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")


def fits_machine(filename: str) -> bool:
    """Installable on CPython 3.12, Linux x86_64 (glibc 2.28 or later): a stable-ABI wheel (abi3) of an earlier
    CPython too (torchao's cp310-abi3)."""
    _, _, pythons, abis, platforms = wheel_tags(filename)

    def stable_abi(tag: str) -> bool:
        found = re.fullmatch(r"cp3(\d+)", tag)
        return "abi3" in abis and bool(found) and int(found[1]) <= 12

    python_ok = any(tag in ("py3", "py312", "cp312") or stable_abi(tag) for tag in pythons)
    abi_ok = any(tag in ("none", "abi3", "cp312") for tag in abis)

    def platform_ok(tag: str) -> bool:
        if tag == "any" or tag in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"):
            return True
        found = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", tag)
        return bool(found) and (int(found[1]), int(found[2])) <= (2, 28)

    return python_ok and abi_ok and any(platform_ok(tag) for tag in platforms)


def check_wheels(directory: Path, packages: list[tuple[str, str, str]]) -> list[dict]:
    wheels = sorted(directory.glob("*.whl"))
    found = {}
    for wheel in wheels:
        name, version, *_ = wheel_tags(wheel.name)
        if normalize(name) in found:
            raise BuildError(f"two wheels of {name} in {directory}: one version of each, or the install stops")
        if not fits_machine(wheel.name):
            raise BuildError(f"{wheel.name} is not for CPython {PYTHON_VERSION} on manylinux x86_64")
        found[normalize(name)] = version
    wanted = {normalize(name): version for name, version, _ in packages}
    if found != wanted:
        raise BuildError(f"wheels {found} are not the pinned {wanted}")
    return [
        {"file": w.name, "bytes": w.stat().st_size, "sha256": hashlib.sha256(w.read_bytes()).hexdigest()}
        for w in wheels
    ]


def machine_requirements(directory: Path) -> list[str]:
    """The wheels' own needs that none of the carried wheels provides: the machine must have them (run.sh checks)."""
    carried, needs = set(), set()
    for wheel in directory.glob("*.whl"):
        carried.add(normalize(wheel_tags(wheel.name)[0]))
        with zipfile.ZipFile(wheel) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            for line in archive.read(metadata).decode().splitlines():
                if line.startswith("Requires-Dist:") and ";" not in line:  # markers: extras, old Pythons, platforms
                    needs.add(line.split(":", 1)[1].strip().replace(" ", ""))
    merged: dict[str, list[str]] = {}
    for need in sorted(needs):
        name = re.split(r"[<>=!~\[(]", need)[0]
        merged.setdefault(normalize(name), []).extend(s for s in need[len(name) :].split(",") if s)
    return [name + ",".join(sorted(set(specs))) for name, specs in sorted(merged.items()) if name not in carried]


def tracked_files(root: Path) -> list[str]:
    """What the device tool sends: tracked files and untracked ones git does not ignore."""
    done = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted({p for p in done.stdout.split("\0") if p and (root / p).is_file()})


def write_archive(root: Path, target: Path, kind: str) -> dict:
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if kind == "head":
        subprocess.run(["git", "-C", str(root), "archive", "--format=tar.gz", "-o", str(target), "HEAD"], check=True)
        return {"archive": "git archive HEAD", "commit": commit}
    files = tracked_files(root)
    with tarfile.open(target, "w:gz") as tar:
        for path in files:
            tar.add(root / path, arcname=path, recursive=False)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True).stdout
    return {
        "archive": "the working tree (tracked and untracked-not-ignored files)",
        "commit": commit,
        "uncommitted_changes": bool(dirty.strip()),
        "files": len(files),
    }


def write_assets(assets: Path, target: Path) -> list[str]:
    missing = [name for name in ASSETS if not (assets / name).is_file()]
    if missing:
        raise BuildError(
            f"{assets} lacks {', '.join(missing)} (the shared assets: --assets DIR, or --no-assets "
            "for chattune's demo tokenizer and chats, which bench_gpu.py cannot use)"
        )
    with tarfile.open(target, "w:gz") as tar:
        for name in ASSETS:
            tar.add(assets / name, arcname=name)
    return ASSETS


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def tree_bytes(root: Path) -> int:
    return sum((root / p).stat().st_size for p in tracked_files(root))


def carry_path(folder: Path, root: Path) -> str:
    try:
        return str(folder.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(folder)  # outside the repo: the device tool cannot carry it from there


def command_for(folder: str, budget: int, extra: str = "") -> str:
    command = f'bash {folder}/run.sh --results "$OUT" --budget {budget}{extra}'
    assert len(command) <= COMMAND_LIMIT, (
        f"the command is {len(command)} characters (the device tool takes {COMMAND_LIMIT})"
    )
    return command


def build(args: argparse.Namespace) -> dict:
    started = time.time()
    folder = args.out.resolve()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    packages = PACKAGES + [(*spec.split("=="), "--extra") for spec in args.extra]
    fetch_wheels(folder / "wheels", packages)
    manifest = {
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "wheels": check_wheels(folder / "wheels", packages),
        "machine_requirements": machine_requirements(folder / "wheels"),
        "imports": [{"module": m, "required": r, "from": f} for m, r, f in IMPORTS],
        "minimum": {k: ".".join(map(str, v)) for k, v in MINIMUM.items()},
        "project": write_archive(args.root, folder / "project.tar.gz", args.archive),
        "assets": [] if args.no_assets else write_assets(args.assets, folder / "assets.tar.gz"),
        "budget": args.budget,
    }
    shutil.copy(ROOT / "scripts" / "gpu_carry_run.sh", folder / "run.sh")
    (folder / "run.sh").chmod(0o755)
    shutil.copy(Path(__file__), folder / "gpu_carry.py")
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    folders = [folder]
    if args.with_bitsandbytes:
        bnb = args.bnb_out.resolve()
        if bnb.exists():
            shutil.rmtree(bnb)
        fetch_wheels(bnb / "wheels", [BITSANDBYTES])
        check_wheels(bnb / "wheels", [BITSANDBYTES])
        folders.append(bnb)
    sizes = {f: folder_bytes(f) for f in folders}
    tree = tree_bytes(args.root)
    for f, size in sizes.items():
        if size >= CARRY_LIMIT:
            raise BuildError(f"{f} holds {size / MIB:.1f} MiB: the device tool carries at most 64 MiB")
    first = tree + sizes[folder]
    if first >= CARRY_LIMIT:
        raise BuildError(
            f"the working tree ({tree / MIB:.1f} MiB) and {folder} ({sizes[folder] / MIB:.1f} MiB) "
            "together pass the device tool's 64 MiB"
        )
    if len(folders) > 1 and first + sizes[folders[1]] >= CARRY_LIMIT:
        raise BuildError(
            f"the working tree, {folder} and {folders[1]} together hold "
            f"{(first + sizes[folders[1]]) / MIB:.1f} MiB: over the device tool's 64 MiB"
        )
    name = carry_path(folder, args.root)
    report = {
        "folder": str(folder),
        "bytes": sizes[folder],
        "tree_bytes": tree,
        "carry": [name],
        "command": command_for(name, args.budget),
        "seconds": time.time() - started,
    }
    if len(folders) > 1:
        bnb_name = carry_path(folders[1], args.root)
        report["bnb"] = {
            "folder": str(folders[1]),
            "bytes": sizes[folders[1]],
            "carry": [name, bnb_name],
            "command": command_for(
                name,
                args.budget,
                f" --extra-wheels {bnb_name}/wheels --no-bench --check-args '--only throughput_0.6b_qlora'",
            ),
        }
    return report


def print_report(report: dict, args: argparse.Namespace) -> None:
    manifest = json.loads((Path(report["folder"]) / "MANIFEST.json").read_text())
    print(
        f"folder: {report['folder']} ({report['bytes'] / MIB:.1f} MiB; the working tree beside it "
        f"{report['tree_bytes'] / MIB:.1f} MiB; limit 64 MiB together)"
    )
    print(f"  wheels: {', '.join(w['file'] for w in manifest['wheels'])}")
    print(
        f"  project: {manifest['project']['archive']} at {manifest['project']['commit'][:12]}; assets: "
        f"{', '.join(manifest['assets']) or 'none (--no-assets)'}"
    )
    print(f"  the machine must have: {', '.join(manifest['machine_requirements'])}")
    print(f"carry: {json.dumps(report['carry'])}")
    print(f"command ({len(report['command'])} characters): {report['command']}")
    if "bnb" in report:
        bnb = report["bnb"]
        print(f"second call, the QLoRA rows (bitsandbytes; {bnb['folder']}, {bnb['bytes'] / MIB:.1f} MiB):")
        print(f"  carry: {json.dumps(bnb['carry'])}")
        print(f"  command: {bnb['command']}")
    else:
        print(
            "second call, the QLoRA rows: python scripts/gpu_carry.py --with-bitsandbytes (a folder of its own, "
            "then the command it prints); run.sh's summary prints the second command for what did not fit"
        )


# --- on the GPU machine (called by run.sh; the standard library only) ---


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def check_env(folder: Path, target: Path, dry_run: bool, allow_cpu: bool = False) -> int:
    """Versions, the imports the runs need (naming what is missing) and the wheels' needs the machine must meet."""
    import importlib
    import importlib.metadata as metadata
    import platform

    manifest = json.loads((folder / "MANIFEST.json").read_text())
    minimum = {k: version_tuple(v) for k, v in manifest["minimum"].items()}
    problems, notes = [], []
    versions = {"python": platform.python_version()}
    if sys.version_info[:2] != tuple(map(int, manifest["python"].split("."))):
        notes.append(f"python {versions['python']}: the wheels are for {manifest['python']} (multiprocess's is)")
    if sys.version_info[:2] < minimum["python"]:
        problems.append(f"python {versions['python']} < {manifest['minimum']['python']}")
    missing, optional, carried = [], [], []
    for entry in manifest["imports"]:
        try:
            module = importlib.import_module(entry["module"])
        except Exception as error:  # an import can fail on a version clash as well as on absence
            message = f"{entry['module']} ({entry['from']}): {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            (missing if entry["required"] else optional).append(message)
            continue
        top = entry["module"].split(".")[0]
        if str(Path(getattr(module, "__file__", None) or "/").resolve()).startswith(str(target.resolve()) + os.sep):
            carried.append(top)
        if top in ("torch", "transformers"):
            versions[top] = getattr(module, "__version__", "?")
            if version_tuple(versions[top]) < minimum[top]:
                problems.append(f"{top} {versions[top]} < {manifest['minimum'][top]}")
    for need in manifest["machine_requirements"]:
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)(.*)", need).groups()
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            notes.append(f"{need}: not installed (a carried wheel asks for it)")
            continue
        for op, wanted in re.findall(r"(>=|<=|==|<|>)([0-9][0-9.]*)", spec):
            a, b = version_tuple(have), version_tuple(wanted)
            if not {
                ">=": a >= b,
                "<=": a <= b,
                "==": a == b or have.startswith(wanted.rstrip(".*")),
                "<": a < b,
                ">": a > b,
            }[op]:
                notes.append(f"{name} {have} does not meet {need} (carry it: gpu_carry.py --extra {name}==VERSION)")
    try:
        import torch

        versions["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:
        versions["cuda"] = "?"
    print("[gpu_carry] versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    print(f"[gpu_carry] imported from {target}: {', '.join(carried) or 'nothing'}")
    for note in notes:
        print(f"[gpu_carry] note: {note}")
    for line in optional:
        print(f"[gpu_carry] optional, absent: {line}")
    for line in missing:
        print(f"[gpu_carry] MISSING: {line}")
    for problem in problems:
        print(f"[gpu_carry] TOO OLD: {problem}")
    if versions["cuda"] == "none" and not dry_run and not allow_cpu:
        problems.append("no CUDA device")
        print("[gpu_carry] no CUDA device: nothing to check here")
    if missing or problems:
        print(f"[gpu_carry] cannot run: {len(missing)} required import(s) missing, {len(problems)} other problem(s)")
        return 3
    return 0


def summary(
    folder: Path, results: Path, check_args: str, runs: str, carry: str, budget: int, extra_wheels: list[str] = ()
) -> None:
    """What ran, what did not, and the second command for the rest. Reads the scripts' own reports:
    gpu_check.json's rows and `not_run` (the items its budget left out or stopped), bench_gpu's results.json
    rows and their `status` ("ran", "not run (budget ...)", "not finished (...)", "FAIL: ...")."""
    lines, again = [], []
    report = results / "gpu_check" / "gpu_check.json"
    if check_args == "none":
        lines.append("gpu_check: not asked for (--no-check)")
    elif report.is_file():
        facts = json.loads(report.read_text())
        rows = facts["rows"]
        counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP", "NOT RUN")}
        lines.append(
            f"gpu_check: {len(rows)} rows, {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP, "
            f"{counts['NOT RUN']} NOT RUN"
        )
        lines += [f"  FAIL {r['check']}: {r['figure']} {r['detail'][:150]}" for r in rows if r["status"] == "FAIL"]
        lines += [f"  {r['status']} {r['check']}: {r['figure']}" for r in rows if r["status"] in ("SKIP", "NOT RUN")]
        if facts.get("not_run"):
            again.append(f"--no-bench --check-args '--only {' '.join(dict.fromkeys(facts['not_run']))}'")
        if any("bitsandbytes" in r["figure"] for r in rows if r["status"] == "SKIP"):
            lines.append(
                "  QLoRA: bitsandbytes was not carried: python scripts/gpu_carry.py --with-bitsandbytes, "
                "then the second command it prints"
            )
    else:
        lines.append("gpu_check: no report (see logs.tar.gz: gpu_check.log)")
    bench = results / "bench_gpu.json"
    wanted = runs.split() or ["short06", "short17", "long06"]  # bench_gpu.py's default runs
    if runs == "none":
        lines.append("bench_gpu: not asked for (--no-bench)")
        rest = []
    elif bench.is_file():
        rows = json.loads(bench.read_text())
        for r in rows:
            if r.get("status", "ran") == "ran":
                lines.append(
                    f"bench {r['run']} {r['tool']}: {r['tokens_per_s']:,.0f} tokens/s"
                    + (f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else "")
                )
            else:
                lines.append(f"bench {r['run']} {r['tool']}: {r['status']}")
        left_out = {r["run"] for r in rows if r.get("status", "ran").startswith("not ")}  # not run / not finished
        rest = [
            run
            for run in dict.fromkeys(wanted + sorted(left_out))
            if run in left_out or run not in {r["run"] for r in rows}
        ]
    else:
        lines.append("bench_gpu: no results (see logs.tar.gz: bench_gpu.log)")
        rest = wanted
    if rest:
        again.append(f"--no-check --runs '{' '.join(rest)}'")
    # A second call carries and installs what this one did (--extra-wheels: the bitsandbytes folder)
    carried = [
        carry,
        *dict.fromkeys(Path(d).parent.as_posix() if Path(d).name == "wheels" else d for d in extra_wheels),
    ]
    wheels = "".join(f" --extra-wheels {d}" for d in extra_wheels)
    for extra in again:
        lines.append(
            f'second call (carry {json.dumps(carried)}): bash {carry}/run.sh --results "$OUT" --budget {budget}'
            f"{wheels} {extra}"
        )
    if not again:
        lines.append("nothing left for a second call")
    text = "\n".join(lines)
    (results / "summary.txt").write_text(text + "\n")
    print(text)


def main() -> int:
    if sys.argv[1:2] == ["--check-env"]:
        return check_env(
            Path(sys.argv[2]), Path(sys.argv[3]), "--dry-run" in sys.argv[4:], "--allow-cpu" in sys.argv[4:]
        )
    if sys.argv[1:2] == ["--summary"]:
        folder, results, check_args, runs, carry, budget = sys.argv[2:8]
        summary(Path(folder), Path(results), check_args, runs, carry, int(budget), sys.argv[8:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-carry", help="the folder (default: .gpu-carry/)")
    parser.add_argument("--assets", type=Path, default=ROOT.parent / "shared" / "assets")
    parser.add_argument("--no-assets", action="store_true", help="carry no assets (gpu_check uses the demo ones)")
    parser.add_argument(
        "--archive",
        choices=["worktree", "head"],
        default="worktree",
        help="the project archive: the working tree as the device tool sends it, or git archive HEAD",
    )
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="seconds for install and both scripts")
    parser.add_argument("--with-bitsandbytes", action="store_true", help="also build --bnb-out for the QLoRA rows")
    parser.add_argument("--bnb-out", type=Path, default=ROOT / ".gpu-carry-bnb")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME==VERSION",
        help="one more wheel (e.g. one the machine has too old), repeatable",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the report as JSON too")
    args = parser.parse_args()
    if any("==" not in spec for spec in args.extra):
        parser.error("--extra takes NAME==VERSION")
    try:
        report = build(args)
    except BuildError as error:
        print(
            f"gpu_carry: {'the package registry is unreachable: ' if isinstance(error, RegistryError) else ''}{error}",
            file=sys.stderr,
        )
        return 4 if isinstance(error, RegistryError) else 2
    print_report(report, args)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
