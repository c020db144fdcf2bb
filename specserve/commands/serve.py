"""``specserve serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from specserve.commands.args import add_serve_args
from specserve.errors import SpecserveError
from specserve.parallel.launch import ParallelConfig, run_node

LOCK_DRIFT_EXIT = 3
HTTP_GRACE_S = 2  # uvicorn's wait for connections once the drain has ended every request


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API "
                                          "(chat, completions, metrics).")
    add_serve_args(p)
    p.set_defaults(func=run)


def serve_argv(argv: list[str] | None = None) -> list[str]:
    """The flags given after ``serve`` on the command line (what a lock file records)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return argv[argv.index("serve") + 1:] if "serve" in argv else argv


def check_lock(args: argparse.Namespace) -> int:
    """0 when the deployment matches ``--lock``; prints the drifts and returns 3 otherwise."""
    try:
        from specserve import lock
    except ImportError as exc:
        raise SpecserveError(f"--lock needs specserve.lock, which cannot be imported: {exc}") from exc
    drifts = lock.check_lock(args.lock, serve_argv(), args.lock_allow)
    fmt = getattr(lock, "format_drifts", None)
    if fmt is not None:
        print(fmt(drifts, args.lock), file=sys.stderr)
    elif drifts:
        print(f"deployment drifted from {args.lock}:", file=sys.stderr)
        for drift in drifts:
            print(f"  {drift}", file=sys.stderr)
    if not drifts:
        return 0
    print("refusing to start: allow a field with --lock-allow FIELD, or re-lock the deployment",
          file=sys.stderr)
    return LOCK_DRIFT_EXIT


def url_of(host: str, port: int) -> str:
    """The address a client uses: an IPv6 host in brackets; an empty host listens on every interface."""
    if not host:
        return f"http://0.0.0.0:{port} (every interface)"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("specserve")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def run(args: argparse.Namespace) -> int:
    from specserve.server.config import ServerConfig

    level = args.log_level.lower()
    if level not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise SpecserveError(f"--log-level must be one of critical, error, warning, info, debug; got {level!r}")
    pcfg = ParallelConfig.from_args(args)
    if pcfg.node_rank > 0:  # another machine's share of the ranks: workers only, no HTTP
        _setup_logging("debug" if level == "trace" else level)
        return run_node(args, pcfg)
    if args.lock is not None and not args.lock.strip():  # "--lock $UNSET" must not skip the check
        raise SpecserveError("--lock: an empty path (is the variable that names the lock file unset?)")
    if args.lock_allow and args.lock is None:
        raise SpecserveError("--lock-allow applies to --lock, which is not given")
    if args.lock:
        status = check_lock(args)
        if status:
            return status
    cfg = ServerConfig.from_args(args)  # bad --default-chat-template-kwargs fails before the model loads
    _setup_logging("debug" if level == "trace" else level)

    import uvicorn

    from specserve.engine.async_engine import AsyncEngine
    from specserve.server.app import create_app
    from specserve.server.drain import Drain
    from specserve.server.http_protocol import uvicorn_config
    from specserve.server.reasoning import missing_think_tokens

    sock = listen_socket(args.host, args.port)  # a busy port fails now, not after the model loads
    engine = AsyncEngine.from_args(args, own_thread=False)
    missing = missing_think_tokens(cfg.reasoning_parser, engine.tokenizer)
    if missing:
        logging.getLogger("specserve.server").warning(
            "--reasoning-parser %s: the model's tokenizer has no %s token; reasoning is split only where the "
            "model spells the tags out", cfg.reasoning_parser, " or ".join(missing))
    plan = getattr(getattr(engine, "engine", None), "plan", None)
    if plan is not None:
        from specserve.commands.plan import format_plan

        logging.getLogger("specserve.server").info("%s", format_plan(plan))
    _log_kernels()
    drain = Drain(args.shutdown_timeout, engine.fail_all, lambda force: stop_http(server, force))
    app = create_app(engine, cfg, drain)
    logging.getLogger("specserve.server").info(
        "serving %s on %s (speculation %s)", cfg.served_model_name or engine.model_name,
        url_of(args.host, sock.getsockname()[1]), "on" if engine.spec_enabled else "off")
    server = uvicorn.Server(uvicorn_config(app, args.host, args.port, level, HTTP_GRACE_S))
    return run_server(server, engine, sock, drain)


def _log_kernels() -> None:
    from specserve.kernels.library import kernels_info

    info = kernels_info()
    if info["available"]:
        logging.getLogger("specserve.server").info(
            "C kernels: %s build (integer dot: %s; chosen by %s%s)", info["variant"], info["int_dot"],
            info["variant_source"] if info["variant_source"] == "SPECSERVE_KERNEL_VARIANT" else
            "measurement" if info["variant_ms"] else "default",
            f", ms per pass {info['variant_ms']}" if info["variant_ms"] else "")


def stop_http(server, force: bool) -> None:
    """Ask uvicorn to exit (force: without waiting for open connections)."""
    server.should_exit = True
    if force:
        server.force_exit = True


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for host:port (IPv4 or IPv6, as the host resolves), or SpecserveError."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SpecserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise SpecserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def run_server(server, engine, sock: socket.socket | None = None, drain=None) -> int:
    """HTTP in a second thread, the engine's step loop in this (the main) thread. SIGINT / SIGTERM
    start the drain (specserve/server/drain.py), which stops the HTTP server once the requests in
    flight have ended; the engine loop ends when the HTTP thread does. Without a drain a signal
    stops uvicorn directly."""
    import signal
    import threading

    http = threading.Thread(target=server.run, name="specserve-http", daemon=True,
                            kwargs={"sockets": [sock]} if sock is not None else {})
    handler, wakeup = server.handle_exit, None
    if drain is not None:  # the signal reaches the drain through the wakeup socket (Drain.listen)
        wakeup = socket.socketpair()
        for end in wakeup:
            end.setblocking(False)
        old_fd = signal.set_wakeup_fd(wakeup[1].fileno(), warn_on_full_buffer=False)
        drain.listen(wakeup[0])
        handler = lambda _signum, _frame: None  # noqa: E731 - the default would kill or raise KeyboardInterrupt
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        engine.run_forever(keep_going=http.is_alive)
    finally:
        server.should_exit = True
        http.join(15)
        close = getattr(getattr(engine, "engine", None), "close", None)
        if close is not None:
            close()  # a tensor-parallel group's workers
        for sig, old in previous.items():
            signal.signal(sig, old)
        if wakeup is not None:
            signal.set_wakeup_fd(old_fd)
            for end in wakeup:
                end.close()
    if getattr(engine, "fatal", None) is not None:
        print(f"specserve: error: {engine.fatal}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
