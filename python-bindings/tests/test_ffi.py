"""The ctypes layer: declarations against the generated header, lazy resolution of missing
symbols, error reporting, enum values, and where the library is found."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

import oxccl
from oxccl import _ffi, _lib

HEADER = Path(__file__).resolve().parents[2] / "include" / "oxccl.h"


def _header_text() -> str:
    if not HEADER.is_file():
        pytest.skip(f"{HEADER} is not here (tests run outside the source checkout)")
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = text.replace("\\\n", " ")  # macro continuation lines
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def _ctype(decl: str) -> str:
    """A C type as DECLARATIONS spells it: no `const`/`struct`, stars attached."""
    toks = [t for t in re.findall(r"\w+|\*", decl) if t not in ("const", "struct")]
    words = " ".join(t for t in toks if t != "*")
    return words + "*" * toks.count("*")


def header_functions() -> dict:
    """name -> (return type, [parameter types]) of every function the header declares."""
    text = _header_text()
    body = text[text.index('extern "C" {') :] if 'extern "C" {' in text else text
    funcs = {}
    for ret, name, params in re.findall(r"([A-Za-z_][\w\s\*]*?)\b(\w+)\s*\(([^()]*)\)\s*;", body):
        params = params.strip()
        types = []
        if params and params != "void":
            for p in params.split(","):
                toks = re.findall(r"\w+|\*", p)
                # the last identifier is the parameter name
                types.append(_ctype(" ".join(toks[:-1])))
        funcs[name] = (_ctype(ret), types)
    return funcs


def test_header_declares_functions():
    funcs = header_functions()
    assert "ncclAllReduce" in funcs and "ncclCommInitRank" in funcs, sorted(funcs)
    assert funcs["ncclAllReduce"] == (
        "ncclResult_t",
        ["void*", "void*", "size_t", "ncclDataType_t", "ncclRedOp_t", "ncclComm_t", "cudaStream_t"],
    )


def test_every_header_function_has_a_binding_with_its_signature():
    problems = []
    for name, (ret, types) in sorted(header_functions().items()):
        decl = _ffi.declaration(name)
        if decl is None:
            problems.append(f"{name}: no binding in oxccl._ffi.DECLARATIONS")
            continue
        want = (decl[0], [t for _, t in decl[1]])
        if want != (ret, types):
            problems.append(
                f"{name}: header has {ret} ({', '.join(types)}), binding has {want[0]} ({', '.join(want[1])})"
            )
    assert not problems, "\n".join(problems)


def test_every_declared_type_maps_to_ctypes():
    for name, (ret, params) in _ffi.DECLARATIONS.items():
        for t in [ret] + [t for _, t in params]:
            assert t in _ffi.CTYPES, f"{name}: C type {t!r} has no ctypes mapping"
    # The full nccl.h 2.x set is declared, including what liboxccl does not have yet.
    for name in (
        "ncclCommInitRankConfig",
        "ncclCommSplit",
        "ncclRedOpCreatePreMulSum",
        "ncclCommGetAsyncError",
        "ncclGroupStart",
        "ncclSend",
        "ncclAlltoAll",
        "ncclCommRegister",
        "ncclMemAlloc",
    ):
        assert name in _ffi.DECLARATIONS


def test_header_enums_match_python():
    text = _header_text()

    def enum(typedef: str) -> dict:
        m = re.search(r"typedef enum\s*\{([^}]*)\}\s*" + typedef + r"\s*;", text)
        assert m, f"{typedef} not found in the header"
        return {k: int(v, 0) for k, v in re.findall(r"(\w+)\s*=\s*(\w+)", m.group(1))}

    results = enum("ncclResult_t")
    assert [results[n] for n in _ffi.RESULT_NAMES] == list(range(len(_ffi.RESULT_NAMES)))
    types = enum("ncclDataType_t")
    nccl_names = [
        "ncclInt8",
        "ncclUint8",
        "ncclInt32",
        "ncclUint32",
        "ncclInt64",
        "ncclUint64",
        "ncclFloat16",
        "ncclFloat32",
        "ncclFloat64",
        "ncclBfloat16",
        "ncclFloat8e4m3",
        "ncclFloat8e5m2",
    ]
    assert [types[n] for n in nccl_names] == [int(d) for d in oxccl.DataType]
    ops = enum("ncclRedOp_t")
    assert [ops[n] for n in ("ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg")] == [
        int(o) for o in oxccl.ReduceOp
    ]


def test_functions_resolve_and_pnccl_aliases_share_declarations():
    lib = oxccl.lib()
    v = ctypes.c_int()
    lib.ncclGetVersion(ctypes.byref(v))
    assert v.value == oxccl.version() and v.value >= 22000
    assert _ffi.declaration("pncclAllReduce") == _ffi.declaration("ncclAllReduce")
    with pytest.raises(AttributeError, match="not a function of nccl.h"):
        lib.ncclNoSuchFunction


def test_a_missing_symbol_raises_not_available_only_when_called():
    class Empty:  # a library exporting nothing
        pass

    lib = _ffi.Library(Empty(), "/nowhere/liboxccl.so")
    assert not lib.has("ncclCommSplit")
    f = lib.ncclCommSplit  # resolving does not fail
    with pytest.raises(oxccl.NotAvailableError, match="ncclCommSplit is not available in this liboxccl") as e:
        f(None, 0, 0, None, None)
    assert e.value.result is None and e.value.function == "ncclCommSplit"
    assert isinstance(e.value, oxccl.Error) and isinstance(e.value, NotImplementedError)


def test_failures_raise_error_with_result_name_and_last_error_text():
    count = ctypes.c_int(-5)
    with pytest.raises(oxccl.Error) as e:
        oxccl.lib().ncclCommCount(0x1234, ctypes.byref(count))
    assert e.value.result == 4 and e.value.result_name == "ncclInvalidArgument"
    assert "not a live communicator" in e.value.detail and "ncclCommCount" in str(e.value)
    assert count.value == -5  # outputs are written only on success
    with pytest.raises(oxccl.Error, match="comm is NULL"):
        oxccl.lib().ncclCommCount(None, ctypes.byref(count))


def test_error_strings():
    lib = oxccl.lib()
    assert lib.ncclGetErrorString(0) == b"no error"
    assert b"invalid argument" in lib.ncclGetErrorString(4)
    assert lib.ncclGetErrorString(1234) == b"unknown result code"


# -- finding the library -------------------------------------------------------------------


def _touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"")
    return p


def test_oxccl_library_variable_wins(tmp_path):
    lib = _touch(tmp_path / "custom" / "liboxccl.so")
    pkg = tmp_path / "pkg"
    _touch(pkg / "lib" / "liboxccl.so")
    assert _lib.find_library({"OXCCL_LIBRARY": str(lib)}, pkg) == lib
    with pytest.raises(_lib.LibraryNotFound, match="OXCCL_LIBRARY=.*does not name a file"):
        _lib.find_library({"OXCCL_LIBRARY": str(tmp_path / "missing.so")}, pkg)


def test_a_checkout_around_the_package_is_not_searched(tmp_path):
    checkout = tmp_path / "src"
    (checkout / "Cargo.toml").parent.mkdir(parents=True)
    (checkout / "Cargo.toml").write_text('[package]\nname = "oxccl"\n')
    _touch(checkout / "target" / "release" / "liboxccl.so")
    pkg = checkout / "python-bindings" / "oxccl"
    pkg.mkdir(parents=True)
    with pytest.raises(_lib.LibraryNotFound):
        _lib.find_library({"CARGO_TARGET_DIR": str(checkout / "target")}, pkg)
    shipped = _touch(pkg / "lib" / "liboxccl.so")
    assert _lib.find_library({}, pkg) == shipped


def test_not_found_names_what_it_looked_for(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    with pytest.raises(_lib.LibraryNotFound) as e:
        _lib.find_library({}, pkg)
    msg = str(e.value)
    assert str(pkg / "lib" / "liboxccl.so") in msg and "OXCCL_LIBRARY" in msg
