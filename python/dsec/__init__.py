"""dsec: the Python client of the dsec worker (stateful sandboxes for agent
training and evaluation), standard library only.

    import dsec

    c = dsec.Client()                      # DSEC_HOST, DSEC_TOKEN, DSEC_TLS_CA, else the local worker
    sb = c.create(layers=["harness:3", "myrepo:abc123", "debian/bookworm:2026.11"], memory=2 << 30)
    res = sb.exec(["pytest", "-x"], id="step-1")   # a failing command is a result, never an exception
    print(res.exit_code, res.stdout)
    snap = sb.pack_diff("rollout-7:12")
    branches = c.branch(snap.name, 8)
    sb.remove(force=True)

dsec.aio has the same client for asyncio. Errors are the Go SDK's classes:
InfraError (the sandbox or worker failed: retry the step with the same id),
NotFound, Conflict, WrongState, Unauthorized, PermissionDenied, Busy,
InvalidArgument, LimitExceeded, all DsecError.
"""

from . import aio
from ._wire import (Busy, CommandFailed, Conflict, DataLoss, DsecError, ExecResult, Grade, InfraError, InvalidArgument,
                    LimitExceeded, NotFound, NotImplementedByWorker, Output, PermissionDenied, PolicyReport, SandboxInfo,
                    Snapshot, Unauthorized, WrongState)
from .client import Client, ExecStream, Sandbox

__all__ = ["Client", "Sandbox", "ExecStream", "ExecResult", "Output", "Snapshot", "Grade", "SandboxInfo", "PolicyReport", "aio",
           "DsecError", "InfraError", "NotFound", "Conflict", "WrongState", "Unauthorized", "PermissionDenied", "Busy",
           "InvalidArgument", "LimitExceeded", "NotImplementedByWorker", "DataLoss", "CommandFailed"]

__version__ = "0.1.0"
