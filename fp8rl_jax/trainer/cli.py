"""Command-line plumbing shared by ``scripts/train.py`` and ``scripts/launch_ray.py``: gin flags -> TrainConfig.

Gin files are parsed with their ``include`` statements resolved against the including file's folder first, then
the repository root (:func:`resolve_include`), so ``include 'configs/quickstart.gin'`` works from any working
directory. ``--print_config`` prints every bindable parameter with its default (:func:`bindable_config_text`).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import sys
from typing import Any, Mapping

#: the repository root: the second place a gin ``include`` is looked for
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

_INCLUDE_RE = re.compile(r"""^\s*include\s+(['"])(?P<name>.+?)\1""", re.MULTILINE)


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--gin_file`` (repeatable), ``--gin_param`` (repeatable), ``--output_dir`` and ``--print_config`` to
    ``parser``."""
    parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. train.num_steps=3")
    parser.add_argument("--output_dir", default=None, help="run directory (overrides train.output_dir)")
    parser.add_argument("--print_config", action="store_true",
                        help="print every bindable gin parameter (all namespaces) with its default, and the value "
                             "the given --gin_file/--gin_param bind, then exit")


class GinIncludeError(ValueError):
    """A gin ``include`` that names no file in the including file's folder nor in the repository root."""


def resolve_include(name: str, including_file: str, root: str = REPO_ROOT) -> str:
    """The file a gin ``include 'name'`` statement in ``including_file`` refers to.

    Looked for relative to the including file's folder, then relative to ``root`` (the repository root); an
    absolute ``name`` is taken as is.

    Returns:
      the absolute path of the included file.

    Raises:
      GinIncludeError: no such file; the one-line message names the including file and every path tried.
    """
    name = os.path.expanduser(name)
    if os.path.isabs(name):
        tried = [name]
    else:
        tried = [os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(including_file)), name)),
                 os.path.abspath(os.path.join(root, name))]
    for path in tried:
        if os.path.isfile(path):
            return path
    raise GinIncludeError(f"{including_file}: include '{name}' not found: tried "
                          + " and ".join(dict.fromkeys(tried)))


@contextlib.contextmanager
def _includes_resolved():
    """While active, gin resolves each file's ``include`` statements as :func:`resolve_include` does.

    gin looks an included name up under its global search prefixes (``_LOCATION_PREFIXES``) with its file readers
    (``_FILE_READERS``); the reader used here sets the prefixes to the opened file's folder and the repository root
    while that file is parsed (and checks its includes first, for the one-line error).
    """
    from gin import config as gin_config

    prefixes, readers = gin_config._LOCATION_PREFIXES, gin_config._FILE_READERS
    saved_prefixes, saved_readers = list(prefixes), list(readers)

    @contextlib.contextmanager
    def reader(path):
        with open(path) as f:
            text = f.read()
        for m in _INCLUDE_RE.finditer(text):
            resolve_include(m.group("name"), path)  # raises the error naming both paths
        outer = list(prefixes)
        prefixes[:] = list(dict.fromkeys([os.path.dirname(os.path.abspath(path)), REPO_ROOT]))
        try:
            with open(path) as f:
                yield f
        finally:
            prefixes[:] = outer

    readers[:] = [(reader, os.path.isfile)]  # only plain files (gin's resource reader logs every miss as an ERROR)
    try:
        yield
    finally:
        prefixes[:] = saved_prefixes
        readers[:] = saved_readers


def parse_gin_files(gin_files, gin_params, finalize: bool = True) -> None:
    """``gin.parse_config_files_and_bindings`` with includes resolved by :func:`resolve_include`.

    Args:
      gin_files: gin files (relative to the working directory, or absolute).
      gin_params: binding strings, applied after the files.
      finalize: lock the config afterwards (``gin.finalize``).

    Raises:
      GinIncludeError: an include that names no file (both paths tried named).
      whatever gin raises for a bad file or binding (ValueError, KeyError, SyntaxError, ImportError, IOError).
    """
    import gin

    with _includes_resolved():
        gin.parse_config_files_and_bindings([os.path.abspath(p) for p in gin_files], list(gin_params),
                                            finalize_config=False)
    if finalize:
        gin.finalize()


def parse_gin_flags(args: argparse.Namespace, flag_bindings: Mapping[str, Any] | None = None) -> str | None:
    """Parse ``args.gin_file`` / ``args.gin_param`` into gin's global config, then apply launcher flags as bindings.

    Args:
      args: parsed flags from a parser given :func:`add_gin_flags`.
      flag_bindings: launcher flag name -> value (None = not given), as
        :func:`fp8rl_jax.trainer.launch.resolve_flag_bindings` takes them; each given flag sets its gin binding, and
        one that contradicts an explicit binding is refused.

    Returns:
      None, or a one-line error for the script to print (exit status 2).
    """
    import gin  # the configurables are registered: importing this module imported the fp8rl_jax.trainer package

    for path in args.gin_file:
        if not os.path.isfile(path):
            return f"gin file not found: {path}"
    gin.clear_config()
    try:
        parse_gin_files(args.gin_file, args.gin_param, finalize=False)
    except (ValueError, KeyError, SyntaxError, ImportError, TypeError, OSError) as e:
        return f"bad gin configuration: {str(e).splitlines()[0]}"
    if flag_bindings:
        from fp8rl_jax.trainer.launch import FLAG_BINDINGS, gin_bound_values, resolve_flag_bindings

        keys = [FLAG_BINDINGS[k] for k in flag_bindings if k in FLAG_BINDINGS]
        try:
            for key, value in resolve_flag_bindings(flag_bindings, gin_bound_values(keys)).items():
                gin.bind_parameter(key, value)
        except ValueError as e:
            return str(e)
    try:
        gin.finalize()
    except (ValueError, KeyError) as e:
        return f"bad gin configuration: {str(e).splitlines()[0]}"
    return None


def config_from_gin_flags(args: argparse.Namespace, *, flag_bindings: Mapping[str, Any] | None = None, **overrides):
    """Parse the gin files/bindings in ``args`` and build the run's ``TrainConfig``.

    Args:
      args: parsed flags from a parser given :func:`add_gin_flags`.
      flag_bindings: launcher flags that set gin bindings (see :func:`parse_gin_flags`).
      overrides: ``TrainConfig`` fields set on top of gin (``output_dir`` from the flag is added here).

    Returns:
      ``(config, None)`` on success, or ``(None, message)`` with a one-line error (missing gin file, an include
      that names no file, a bad or misspelled binding, a flag contradicting a binding, an invalid field value) for
      the script to print and exit with status 2.
    """
    error = parse_gin_flags(args, flag_bindings)
    if error:
        return None, error
    from fp8rl_jax.trainer import TrainConfig

    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    try:
        cfg = TrainConfig(**overrides)
    except (ValueError, TypeError) as e:
        return None, f"bad configuration: {str(e).splitlines()[0]}"  # gin appends "In call to ..." lines
    try:  # the loss settings are built by the trainer later: check their bindings now, before any work
        from fp8rl_jax.objectives import LossConfig
        from fp8rl_jax.trainer.validation import check_field_types

        check_field_types(LossConfig(), "LossConfig")
    except (ValueError, TypeError) as e:
        return None, f"bad configuration: {str(e).splitlines()[0]}"  # gin appends "In call to ..." lines
    return cfg, None


def _binding_source(key: str) -> str:
    """The binding a user sets to change ``key``'s value: the macro it refers to (``MODEL_DIR``) or ``key``."""
    import gin

    from fp8rl_jax.trainer.launch import macro_name

    try:
        value = gin.query_parameter(key)
    except ValueError:
        return key
    name = macro_name(value)
    return name if name is not None else key


def missing_path_error(cfg) -> str | None:
    """A one-line error when a path the run reads is not on this machine, naming the gin binding to set.

    Checks ``train.model`` when it is an absolute path (a packaged name or a hub-style ``org/name`` is resolved
    elsewhere) and, with ``train.task = "file"``, ``prompt_file_dataset.path``. Where the value comes from a gin
    macro (``train.model = %MODEL_DIR``, as in configs/paper/), the macro is the binding named.

    Returns:
      None when every checked path exists, else the message.
    """
    problems = []
    model = os.path.expanduser(str(cfg.model))
    if os.path.isabs(model) and not os.path.exists(model):
        src = _binding_source("train.model")
        problems.append(f"train.model = {cfg.model!r} does not exist on this machine: set {src} to your copy "
                        f"(--gin_param='{src}=\"/path/to/model\"')")
    if cfg.task == "file":
        import gin

        try:
            from fp8rl_jax.trainer.launch import resolve_macro

            path = resolve_macro(gin.query_parameter("prompt_file_dataset.path"))
        except ValueError:
            path = None
        if isinstance(path, str) and not os.path.isfile(os.path.expanduser(path)):
            src = _binding_source("prompt_file_dataset.path")
            problems.append(f"prompt_file_dataset.path = {path!r} is not a file on this machine: set {src} to your "
                            f"copy (--gin_param='{src}=\"/path/to/train.parquet\"')")
    return "; ".join(problems) or None


def _format_value(value: Any) -> str:
    """A default or bound value as a gin literal (a macro reference as ``%NAME``)."""
    if value is inspect.Parameter.empty:
        return "<required>"
    from fp8rl_jax.trainer.launch import macro_name

    name = macro_name(value)
    if name is not None:
        return f"%{name}"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def bindable_parameters() -> list[tuple[str, str, Any]]:
    """Every parameter of every project configurable gin knows: ``[(namespace, parameter, default)]``.

    The namespace is the shortest name gin accepts (``train``, ``LossConfig``, ``chain_sum_dataset``, ...); a
    parameter without a default has ``inspect.Parameter.empty``. gin's own configurables (``gin.macro``, ...) are
    left out.
    """
    from gin import config as gin_config

    out = []
    for selector, configurable in gin_config._REGISTRY.items():
        if configurable.module == "gin" or selector.startswith("gin."):
            continue
        try:
            sig = inspect.signature(configurable.wrapped)
        except (TypeError, ValueError):
            continue
        name = gin_config._REGISTRY.minimal_selector(selector)
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
                continue
            if configurable.denylist and p.name in configurable.denylist:
                continue
            if configurable.allowlist and p.name not in configurable.allowlist:
                continue
            out.append((name, p.name, p.default))
    return sorted(out, key=lambda t: (t[0].lower(), t[0]))


def bindable_config_text() -> str:
    """What ``--print_config`` prints: one ``namespace.parameter = default`` line per bindable parameter, grouped
    by namespace; a parameter the current gin config binds shows that value, its default in a comment. The macros
    the config defines come first."""
    import gin

    lines = ["# Every bindable gin parameter (namespace.parameter = default). Bind one in a gin file or with",
             "# --gin_param='namespace.parameter=value'; '# default:' marks a value the given gin files bind."]
    macros = [ln for ln in gin.config_str().splitlines() if re.match(r"^[A-Z_][A-Z0-9_]* = ", ln)]
    if macros:
        lines += ["", "# macros defined by the given gin files", *macros]
    last = None
    for ns, param, default in bindable_parameters():
        if ns != last:
            lines += ["", f"# {ns}"]
            last = ns
        try:
            bound = gin.query_parameter(f"{ns}.{param}")
            lines.append(f"{ns}.{param} = {_format_value(bound)}  # default: {_format_value(default)}")
        except ValueError:
            lines.append(f"{ns}.{param} = {_format_value(default)}")
    return "\n".join(lines)


def error_line(e: BaseException) -> str:
    """An exception's message for a user: without the ``In call to configurable '...' (<function ... at 0x...>)``
    lines gin appends to errors raised inside configurables."""
    lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("In call to configurable")]
    return " ".join(ln.strip() for ln in lines) or type(e).__name__


def fail(message: str) -> int:
    """Print ``error: message`` to stderr and return exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2
