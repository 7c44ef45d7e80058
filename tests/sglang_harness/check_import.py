"""``python -m tests.sglang_harness.check_import <sglang dir>``: import the SGLang modules the harness uses.

Prints ``imports ok (<version>)`` on success; used by ``scripts/install_sglang.sh``.
"""

import sys

from tests.sglang_harness.bootstrap import setup


def main(argv: list[str]) -> int:
    rel = setup(argv[0])
    import sglang
    import sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.managers.tokenizer_manager  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.model_executor.model_runner  # noqa: F401
    import sglang.srt.model_loader.weight_utils  # noqa: F401

    print(f"imports ok ({sglang.__version__}, {'.'.join(map(str, rel))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
