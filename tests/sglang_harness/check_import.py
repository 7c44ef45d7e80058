"""``python -m tests.sglang_harness.check_import <sglang dir>``: import the SGLang modules the harness uses.

Prints ``imports ok (<version>)`` on success; used by ``scripts/install_sglang.sh``, which records the
success with ``python -m tests.sglang_harness.check_import --fingerprint``: a digest of what the check depends
on besides the release itself (this file, the bootstrap and stand-ins, the installed torch, triton,
transformers, fastapi and pydantic), so that an unchanged check is not run again.
"""

import hashlib
import importlib.metadata
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def fingerprint() -> str:
    h = hashlib.sha256(sys.version.encode())
    for pkg in ("torch", "triton", "transformers", "fastapi", "pydantic"):
        try:
            h.update(f"{pkg}={importlib.metadata.version(pkg)}\n".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{pkg}=none\n".encode())
    files = [os.path.join(HERE, "bootstrap.py"), os.path.join(HERE, "check_import.py")]
    from tests.sglang_harness.bootstrap import STUBS, STUBS_KERNEL

    for folder in (STUBS, STUBS_KERNEL):
        for root, dirs, names in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    for path in files:
        h.update(os.path.relpath(path, os.path.dirname(HERE)).encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--fingerprint":
        print(fingerprint())
        return 0
    from tests.sglang_harness.bootstrap import setup

    rel = setup(argv[0])
    import sglang
    import sglang.srt.entrypoints.http_server
    import sglang.srt.managers.scheduler
    import sglang.srt.managers.tokenizer_manager
    import sglang.srt.model_executor.model_runner
    import sglang.srt.model_loader.weight_utils

    print(f"imports ok ({sglang.__version__}, {'.'.join(map(str, rel))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
