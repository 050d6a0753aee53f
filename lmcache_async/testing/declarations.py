"""What a tier declares it offers, checked against what it implements.

:func:`declaration_problems` is the check the conformance kit runs
(:meth:`BackendConformanceTests.test_declared_capabilities_are_implemented
<lmcache_async.testing.conformance.BackendConformanceTests.test_declared_capabilities_are_implemented>`);
a tier author may call it directly too. Each problem names the capability, so a tier that
declares one it does not implement fails with a message saying which.
"""

from __future__ import annotations

from typing import Protocol

from lmcache_async.tiers import CAPABILITIES, StorageBackend

__all__ = ["declaration_problems", "declared", "missing_members", "protocol_members"]


def declaration_problems(backend: StorageBackend) -> list[str]:
    """One line per broken declaration of ``backend`` (``[]`` when every ``as_*`` answer is None
    or an object implementing its capability's protocol under the tier's own name): a
    declaration that raises, an answer missing members of the protocol, or one whose ``name``
    is not the tier's."""
    out: list[str] = []
    for cap, (method, protocol) in CAPABILITIES.items():
        try:
            obj = getattr(backend, method)()
        except Exception as exc:
            out.append(f"capability {cap!r}: {method}() raised {type(exc).__name__}: {exc}")
            continue
        if obj is None:
            continue
        missing = missing_members(obj, protocol)
        if missing:
            out.append(
                f"capability {cap!r} is declared ({method}() answers {type(obj).__name__}) but not implemented: "
                f"{protocol.__name__} needs {', '.join(missing)}"
            )
        elif getattr(obj, "name", backend.name) != backend.name:
            out.append(f"capability {cap!r}: {method}() answers an object named {obj.name!r}, not {backend.name!r}")
    if not isinstance(backend.reports_removals, bool):
        out.append("reports_removals must be a bool")
    return out


def declared(backend: StorageBackend) -> dict[str, object]:
    """The capabilities ``backend`` declares: name → the object it offers (see
    :data:`CAPABILITIES`)."""
    out: dict[str, object] = {}
    for cap, (method, _) in CAPABILITIES.items():
        obj = getattr(backend, method)()
        if obj is not None:
            out[cap] = obj
    return out


def protocol_members(protocol: type) -> list[str]:
    """The attributes and methods ``protocol`` (a :class:`typing.Protocol`) asks for, bases included."""
    names: set[str] = set()
    for base in protocol.__mro__:
        if base in (object, Protocol) or base.__name__ in ("Protocol", "Generic"):
            continue
        names.update(getattr(base, "__annotations__", {}))
        names.update(n for n in vars(base) if not n.startswith("_"))
    return sorted(n for n in names if not n.startswith("_"))


def missing_members(obj: object, protocol: type) -> list[str]:
    """Members of ``protocol`` that ``obj`` lacks, or has but not callable where the protocol
    has a method (``[]`` when ``obj`` implements it)."""
    out = []
    for member in protocol_members(protocol):
        proto_attr = getattr(protocol, member, None)
        if not hasattr(obj, member) or (callable(proto_attr) and not callable(getattr(obj, member))):
            out.append(member)
    return out
