"""``specserve lock`` and ``specserve verify``.

    specserve lock --out deploy.lock -- --model m.gguf --max-num-seqs 4
    specserve verify deploy.lock [--lock-allow FIELD ...] [--full] [-- <serve args>]
    specserve lock --update --out deploy.lock [-- <serve args>]
"""

from __future__ import annotations

import argparse
import time

from specserve.errors import SpecserveError

EPILOG = ("Serve arguments go after `--`. Fields are dotted paths such as packages.numpy, "
          "model.files.<name>.sha256, serve.max_num_seqs, chat_template.sha256.")


def _lock_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="deploy.lock", help="lock file to write (default: deploy.lock)")
    p.add_argument("--update", action="store_true",
                   help="rewrite an existing lock after an intended change and print what changed "
                        "(serve arguments default to the ones stored in it)")
    p.add_argument("--full", action="store_true", help="rehash every file, ignoring the hash cache")


def _verify_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lock-allow", action="append", default=[], metavar="FIELD",
                   help="let FIELD drift: a field, a prefix (packages) or a glob (packages.*); repeatable")
    p.add_argument("--full", action="store_true", help="rehash every file, ignoring the hash cache")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``lock`` and ``verify``."""
    lock = subparsers.add_parser("lock", help="record the deployment in a lock file", epilog=EPILOG,
                                 description="Record versions, native library / model / template hashes, "
                                             "serve flags and device in a lock file.")
    _lock_options(lock)
    lock.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS", help="specserve serve arguments")
    lock.set_defaults(func=run_lock)
    verify = subparsers.add_parser("verify", help="check the deployment against a lock file", epilog=EPILOG,
                                   description="Recompute the fingerprint and compare it with the lock; "
                                               "exit 3 naming every field that drifted.")
    _verify_options(verify)
    verify.add_argument("rest", nargs=argparse.REMAINDER, metavar="LOCK_FILE [-- SERVE_ARGS]",
                        help="the lock file, then optionally -- and serve arguments (default: the locked ones)")
    verify.set_defaults(func=run_verify)


def _split(rest: list[str]) -> tuple[list[str], list[str] | None]:
    """``[a, --, b]`` -> ``([a], [b])``; without ``--`` the serve arguments are None."""
    if "--" not in rest:
        return list(rest), None
    i = rest.index("--")
    return rest[:i], rest[i + 1:]


def _reparse(args: argparse.Namespace, head: list[str], prog: str, options, positional: str | None) -> None:
    """Options that argparse's REMAINDER left in ``head`` (e.g. ``verify x --full``)."""
    p = argparse.ArgumentParser(prog=prog, add_help=False)
    options(p)
    if positional:
        p.add_argument(positional)
    p.parse_args(head, namespace=args)


def run_lock(args: argparse.Namespace) -> int:
    """``specserve lock``: write (or ``--update``) the lock file."""
    from specserve.lock import build_lock, check_lock_path, update_lock, write_lock

    head, serve_argv = _split(args.rest)
    _reparse(args, head, "specserve lock", _lock_options, None)
    start = time.monotonic()
    check_lock_path(args.out, "--out")
    if args.update:
        changes = update_lock(args.out, serve_argv, full=args.full)
        for change in changes:
            print(change)
        print(f"updated {args.out}: {len(changes)} field(s) changed ({time.monotonic() - start:.1f} s)")
        return 0
    lock = build_lock(serve_argv or [], full=args.full)
    write_lock(args.out, lock)
    fp = lock["fingerprint"]
    print(f"wrote {args.out}: model {fp['model']['name']}, {len(fp['packages'])} packages, "
          f"{len(fp['native'])} native libraries ({time.monotonic() - start:.1f} s)")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """``specserve verify``: exit 0 when the deployment matches the lock, 3 on drift."""
    from specserve.lock import DRIFT_EXIT, check_lock, format_drifts

    head, serve_argv = _split(args.rest)
    _reparse(args, head, "specserve verify", _verify_options, "lock_file")
    if not getattr(args, "lock_file", None):
        raise SpecserveError("verify needs a lock file: specserve verify deploy.lock")
    drifts = check_lock(args.lock_file, serve_argv, args.lock_allow, full=args.full)
    print(format_drifts(drifts, args.lock_file))
    return DRIFT_EXIT if drifts else 0
