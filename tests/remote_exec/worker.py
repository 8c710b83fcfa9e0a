"""A minimal remote execution worker (bot) for the remote execution test: a TEST FIXTURE.

It stands in for a production worker (BuildBox's buildbox-worker + buildbox-run, Buildbarn's bb_worker +
bb_runner), which cannot be installed here. It speaks the same protocols as they do to the same server
(tools/remote/rbe-server's BuildGrid): the Remote Workers API (google.devtools.remoteworkers.v1test2 Bots:
CreateBotSession, then an UpdateBotSession loop) to take leases, and the Remote Execution API's CAS and
ByteStream (build.bazel.remote.execution.v2, google.bytestream) to fetch inputs and upload outputs. It is not
a production worker: no sandbox, no container (--image-env only imitates an image's ENV), no local CAS cache
(each action downloads its whole input root), actions run as the worker's own user.

Run it with BuildGrid's venv Python (the protos and grpcio ship there):

    <buildgrid-venv>/bin/python tests/remote_exec/worker.py --remote grpc://127.0.0.1:N [--instance ""] \\
        --work-dir DIR [--slots K] [--property OSFamily=linux ...] [--image-env KEY=VALUE ...] [--log FILE] \\
        [--bot-id ID]

Protocol, as BuildGrid 0.9.1's bots service and SQL scheduler implement it:
 - The bot's Worker carries one Device whose properties are the --property pairs (the scheduler matches
   actions' platform properties against the first device's) and a `capacity` config (--slots): BuildGrid
   assigns up to that many leases at once.
 - A lease arrives ACTIVE, its payload an Action packed in Any (or, for jobs stored without it, the Action's
   Digest). The bot echoes each lease back (id, state ACTIVE) on every UpdateBotSession as a heartbeat, and
   reports it once as COMPLETED with `result` = the ActionResult packed in Any and `status` = the execution's
   google.rpc.Status. BuildGrid retries a job whose lease completes INTERNAL or UNAVAILABLE on another bot; a
   bot that misses its keepalive has its session closed and its leases requeued.
 - A lease the server stops sending back has been cancelled (or given to another bot): its process is killed
   and nothing is reported.
 - While the bot has free capacity BuildGrid long-polls UpdateBotSession (up to 80% of the keepalive); the bot
   cancels that call whenever a lease finishes, so completions are reported at once.

Per lease: the Action, Command and input root come from the CAS (BatchReadBlobs for blobs up to 1 MiB,
ByteStream Read above); the tree is staged in a fresh directory under --work-dir (executable bits, symlinks,
empty directories); parents of every declared output are created, and declared output directories
themselves (as Bazel's local execution does); Command.arguments run in root/working_directory, in their own
process group, with an environment of exactly the Command's variables plus the --image-env pairs (the
Command's win); Action.timeout is honoured (the process group is killed, the status is DEADLINE_EXCEEDED).
Outputs are uploaded (FindMissingBlobs first; BatchUpdateBlobs for small blobs, ByteStream Write for large):
files with is_executable, directories as Tree protos, stdout and stderr as blobs. A declared output the
command did not create is left out of the ActionResult (Bazel reports it). The staging directory is removed.

Failures of the worker itself (not the command's exit code): a missing input blob completes the lease with
FAILED_PRECONDITION and a PreconditionFailure naming the blob (Bazel re-uploads it and retries); a gRPC error
talking to the CAS with UNAVAILABLE (BuildGrid retries the job, up to its max-job-attempts); anything else
with UNKNOWN and the error's text. A command that cannot be started (no such program) is reported like a
shell would: exit code 127 (126: not executable), the reason on stderr. The worker keeps going either way.

SIGTERM/SIGINT: running commands are killed, their leases reported UNAVAILABLE (so BuildGrid requeues them at
once) with the bot's status BOT_TERMINATING, and the worker exits 0.

Log (--log FILE, appended, else stderr), one line per event, its keyword first and `@HH:MM:SS.mmm pid N` last:
    start DIGEST ARG0 hint=OUTPUT (inputs staged in S s)          the command begins (tests wait for `^start`)
    done DIGEST ARG0 hint=OUTPUT exit=N status=CODE [(message)] S s  one per action: the line to read
    cancelled / error / dropped lease / session / retry / stopping / stopped
DIGEST is the action's (hash/size), ARG0 the Command's first argument, OUTPUT its first declared output (Bazel
sends no mnemonic to workers; the output path says which target and rule it is).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import io
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
import uuid

import grpc
from google.protobuf import timestamp_pb2

from buildgrid._protos.build.bazel.remote.execution.v2 import remote_execution_pb2 as re_pb2
from buildgrid._protos.build.bazel.remote.execution.v2 import remote_execution_pb2_grpc as re_grpc
from buildgrid._protos.google.bytestream import bytestream_pb2, bytestream_pb2_grpc
from buildgrid._protos.google.devtools.remoteworkers.v1test2 import bots_pb2, bots_pb2_grpc, worker_pb2
from buildgrid._protos.google.rpc import code_pb2, error_details_pb2, status_pb2

SMALL_BLOB = 1 << 20  # blobs up to this size go through the batch RPCs, larger ones through ByteStream
BATCH_BYTES = 3 << 20  # payload per batch request (gRPC's and BuildGrid's limit is 4 MiB per message)
BATCH_COUNT = 400  # blobs per batch request (BuildGrid's MAX_REQUEST_COUNT is 500)
CHUNK = 1 << 20  # ByteStream Write chunk
MAX_MESSAGE = 64 << 20
UPDATE_TIMEOUT = 60.0  # UpdateBotSession deadline; BuildGrid long-polls at most 80% of min(this, keepalive)
FETCH_THREADS = 4

LOG_LOCK = threading.Lock()
LOG_FILE = sys.stderr


def log(msg: str) -> None:
    """One line (continuation lines indented), the event's keyword first, the time and PID last."""
    stamp = f"@{datetime.datetime.now().strftime('%H:%M:%S.%f')[:-3]} pid {os.getpid()}"
    first, *rest = msg.splitlines() or [""]
    line = f"{first}  {stamp}\n" + "".join(f"    {r}\n" for r in rest)
    with LOG_LOCK:
        LOG_FILE.write(line)
        LOG_FILE.flush()


def now_ts() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


def digest_of(data: bytes) -> re_pb2.Digest:
    return re_pb2.Digest(hash=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def digest_of_file(path: str) -> re_pb2.Digest:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return re_pb2.Digest(hash=h.hexdigest(), size_bytes=size)


def dstr(d: re_pb2.Digest) -> str:
    return f"{d.hash}/{d.size_bytes}"


class MissingBlob(Exception):
    def __init__(self, digest: re_pb2.Digest, where: str):
        super().__init__(f"blob {dstr(digest)} ({where}) is not in the CAS")
        self.digest = digest


class Cancelled(Exception):
    pass


class CasError(Exception):
    """A gRPC failure talking to the CAS (transient as far as the job is concerned)."""


# ------------------------------------------------------------------------------------------------------------
# CAS client


class Cas:
    def __init__(self, channel: grpc.Channel, instance: str):
        self.instance = instance
        self.cas = re_grpc.ContentAddressableStorageStub(channel)
        self.bs = bytestream_pb2_grpc.ByteStreamStub(channel)

    def _prefix(self) -> str:
        return f"{self.instance}/" if self.instance else ""

    # -- reads

    def read_small(self, digests: list[re_pb2.Digest], where: str) -> dict[str, bytes]:
        """Blobs (each at most SMALL_BLOB) by hash, in as few BatchReadBlobs calls as the limits allow."""
        out: dict[str, bytes] = {}
        todo = {}
        for d in digests:
            if d.size_bytes == 0:
                out[d.hash] = b""
            else:
                todo[d.hash] = d
        batch: list[re_pb2.Digest] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if not batch:
                return
            try:
                resp = self.cas.BatchReadBlobs(
                    re_pb2.BatchReadBlobsRequest(instance_name=self.instance, digests=batch), timeout=120
                )
            except grpc.RpcError as e:
                raise CasError(f"BatchReadBlobs: {e.code().name}: {e.details()}") from e
            for r in resp.responses:
                if r.status.code == code_pb2.NOT_FOUND:
                    raise MissingBlob(r.digest, where)
                if r.status.code != code_pb2.OK:
                    raise CasError(f"BatchReadBlobs {dstr(r.digest)}: code {r.status.code}: {r.status.message}")
                out[r.digest.hash] = r.data
            batch, size = [], 0

        for d in todo.values():
            if d.size_bytes > SMALL_BLOB:
                out[d.hash] = self.read_bytestream(d, where)
                continue
            if batch and (size + d.size_bytes > BATCH_BYTES or len(batch) >= BATCH_COUNT):
                flush()
            batch.append(d)
            size += d.size_bytes
        flush()
        for d in todo.values():
            if d.hash not in out:
                raise MissingBlob(d, where)
        return out

    def read_blob(self, d: re_pb2.Digest, where: str) -> bytes:
        if d.size_bytes > SMALL_BLOB:
            return self.read_bytestream(d, where)
        return self.read_small([d], where)[d.hash]

    def _read_stream(self, d: re_pb2.Digest, where: str):
        name = f"{self._prefix()}blobs/{d.hash}/{d.size_bytes}"
        try:
            for resp in self.bs.Read(bytestream_pb2.ReadRequest(resource_name=name), timeout=3600):
                yield resp.data
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise MissingBlob(d, where) from e
            raise CasError(f"ByteStream Read {name}: {e.code().name}: {e.details()}") from e

    def read_bytestream(self, d: re_pb2.Digest, where: str) -> bytes:
        buf = io.BytesIO()
        for data in self._read_stream(d, where):
            buf.write(data)
        if buf.tell() != d.size_bytes:
            raise CasError(f"ByteStream Read {dstr(d)}: got {buf.tell()} bytes")
        return buf.getvalue()

    def read_to_file(self, d: re_pb2.Digest, path: str, where: str) -> None:
        n = 0
        with open(path, "wb") as f:
            for data in self._read_stream(d, where):
                f.write(data)
                n += len(data)
        if n != d.size_bytes:
            raise CasError(f"ByteStream Read {dstr(d)}: got {n} bytes")

    # -- writes

    def find_missing(self, digests: list[re_pb2.Digest]) -> set[str]:
        missing: set[str] = set()
        for i in range(0, len(digests), 5000):
            try:
                resp = self.cas.FindMissingBlobs(
                    re_pb2.FindMissingBlobsRequest(instance_name=self.instance, blob_digests=digests[i : i + 5000]),
                    timeout=120,
                )
            except grpc.RpcError as e:
                raise CasError(f"FindMissingBlobs: {e.code().name}: {e.details()}") from e
            missing.update(d.hash for d in resp.missing_blob_digests)
        return missing

    def upload(self, blobs: dict[str, tuple[re_pb2.Digest, bytes | str]]) -> None:
        """blobs: hash -> (digest, bytes or a file path). Uploads those the CAS lacks."""
        blobs = {h: v for h, v in blobs.items() if v[0].size_bytes > 0}
        if not blobs:
            return
        missing = self.find_missing([d for d, _ in blobs.values()])
        batch: list[re_pb2.BatchUpdateBlobsRequest.Request] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if not batch:
                return
            try:
                resp = self.cas.BatchUpdateBlobs(
                    re_pb2.BatchUpdateBlobsRequest(instance_name=self.instance, requests=batch), timeout=120
                )
            except grpc.RpcError as e:
                raise CasError(f"BatchUpdateBlobs: {e.code().name}: {e.details()}") from e
            for r in resp.responses:
                if r.status.code != code_pb2.OK:
                    raise CasError(f"BatchUpdateBlobs {dstr(r.digest)}: code {r.status.code}: {r.status.message}")
            batch, size = [], 0

        for h in sorted(missing):
            d, src = blobs[h]
            if d.size_bytes > SMALL_BLOB:
                self.write_bytestream(d, src)
                continue
            data = src if isinstance(src, bytes) else open(src, "rb").read()
            if batch and (size + d.size_bytes > BATCH_BYTES or len(batch) >= BATCH_COUNT):
                flush()
            batch.append(re_pb2.BatchUpdateBlobsRequest.Request(digest=d, data=data))
            size += d.size_bytes
        flush()

    def write_bytestream(self, d: re_pb2.Digest, src: bytes | str) -> None:
        name = f"{self._prefix()}uploads/{uuid.uuid4()}/blobs/{d.hash}/{d.size_bytes}"

        def requests():
            f = io.BytesIO(src) if isinstance(src, bytes) else open(src, "rb")
            with f:
                offset = 0
                while True:
                    data = f.read(CHUNK)
                    last = offset + len(data) >= d.size_bytes
                    yield bytestream_pb2.WriteRequest(
                        resource_name=name if offset == 0 else "",
                        write_offset=offset,
                        finish_write=last,
                        data=data,
                    )
                    offset += len(data)
                    if last or not data:
                        return

        try:
            resp = self.bs.Write(requests(), timeout=3600)
        except grpc.RpcError as e:
            raise CasError(f"ByteStream Write {name}: {e.code().name}: {e.details()}") from e
        if resp.committed_size not in (d.size_bytes, -1):
            raise CasError(f"ByteStream Write {name}: committed {resp.committed_size} of {d.size_bytes} bytes")


# ------------------------------------------------------------------------------------------------------------
# One lease


def safe_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"invalid path component in the input tree: {name!r}")
    return name


def safe_relpath(path: str) -> str:
    norm = os.path.normpath(path) if path else "."
    if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
        raise ValueError(f"path escapes the input root: {path!r}")
    return norm


class Execution:
    """Runs one lease's action; the result is a completed Lease proto (or None when cancelled)."""

    def __init__(self, bot: "Bot", lease: bots_pb2.Lease):
        self.bot = bot
        self.lease_id = lease.id
        self.payload = lease.payload
        self.cancel_event = threading.Event()
        self.process: subprocess.Popen | None = None
        self.proc_lock = threading.Lock()
        self.completed: bots_pb2.Lease | None = None
        self.thread = threading.Thread(target=self._run, name=f"lease-{lease.id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def cancel(self) -> None:
        self.cancel_event.set()
        with self.proc_lock:
            if self.process is not None and self.process.poll() is None:
                kill_group(self.process)

    def _check_cancel(self) -> None:
        if self.cancel_event.is_set():
            raise Cancelled()

    def _run(self) -> None:
        t0 = time.monotonic()
        cas = self.bot.cas
        meta = re_pb2.ExecutedActionMetadata(worker=self.bot.bot_id)
        meta.worker_start_timestamp.CopyFrom(now_ts())
        action_digest = re_pb2.Digest()
        arg0 = "?"
        hint = ""
        status = status_pb2.Status(code=code_pb2.OK)
        result = re_pb2.ActionResult()
        exit_code: int | str = "-"
        staging = os.path.join(self.bot.work_dir, f"lease-{uuid.uuid4().hex[:12]}")
        try:
            # The Action (packed in the payload, or named by a Digest there), its Command, its input root.
            if self.payload.Is(re_pb2.Action.DESCRIPTOR):
                action = re_pb2.Action()
                self.payload.Unpack(action)
                action_digest = digest_of(action.SerializeToString())
            elif self.payload.Is(re_pb2.Digest.DESCRIPTOR):
                self.payload.Unpack(action_digest)
                action = re_pb2.Action.FromString(cas.read_blob(action_digest, "the Action"))
            else:
                raise ValueError(f"lease payload is neither an Action nor a Digest: {self.payload.type_url}")
            meta.input_fetch_start_timestamp.CopyFrom(now_ts())
            command = re_pb2.Command.FromString(cas.read_blob(action.command_digest, "the Command"))
            arg0 = command.arguments[0] if command.arguments else "?"
            outputs = list(command.output_paths) or list(command.output_files) + list(command.output_directories)
            hint = outputs[0] if outputs else ""

            root = os.path.join(staging, "root")
            os.makedirs(root)
            self._stage(action.input_root_digest, root)
            self._check_cancel()
            meta.input_fetch_completed_timestamp.CopyFrom(now_ts())

            workdir = os.path.normpath(os.path.join(root, safe_relpath(command.working_directory)))
            os.makedirs(workdir, exist_ok=True)
            for p in list(command.output_paths) + list(command.output_files) + list(command.output_directories):
                os.makedirs(os.path.dirname(os.path.join(workdir, safe_relpath(p))) or workdir, exist_ok=True)
            if not command.output_paths:
                for p in command.output_directories:
                    os.makedirs(os.path.join(workdir, safe_relpath(p)), exist_ok=True)

            env = dict(self.bot.image_env)
            env.update((v.name, v.value) for v in command.environment_variables)
            timeout = action.timeout.ToTimedelta().total_seconds() if action.HasField("timeout") else 0.0

            stdout_path = os.path.join(staging, "stdout")
            stderr_path = os.path.join(staging, "stderr")
            log(
                f"start {dstr(action_digest)} {arg0} hint={hint or '-'} "
                f"(inputs staged in {time.monotonic() - t0:.1f}s)"
            )
            meta.execution_start_timestamp.CopyFrom(now_ts())
            exit_code, timed_out = self._execute(
                list(command.arguments), workdir, env, timeout, stdout_path, stderr_path
            )
            meta.execution_completed_timestamp.CopyFrom(now_ts())
            self._check_cancel()
            result.exit_code = exit_code
            if timed_out:
                status = status_pb2.Status(
                    code=code_pb2.DEADLINE_EXCEEDED,
                    message=f"the action exceeded its timeout of {timeout:g} s and was killed",
                )

            meta.output_upload_start_timestamp.CopyFrom(now_ts())
            self._collect_outputs(command, workdir, stdout_path, stderr_path, result)
            meta.output_upload_completed_timestamp.CopyFrom(now_ts())
        except Cancelled:
            log(f"cancelled {dstr(action_digest)} {arg0} hint={hint or '-'} after {time.monotonic() - t0:.1f}s")
            shutil.rmtree(staging, ignore_errors=True)
            return
        except (MissingBlob, CasError) as e:
            if self.cancel_event.is_set():
                shutil.rmtree(staging, ignore_errors=True)
                return
            if isinstance(e, CasError):
                status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=f"worker {self.bot.bot_id}: CAS: {e}")
            else:
                status = status_pb2.Status(
                    code=code_pb2.FAILED_PRECONDITION, message=f"worker {self.bot.bot_id}: {e}"
                )
                failure = error_details_pb2.PreconditionFailure()
                failure.violations.add(type="MISSING", subject=f"blobs/{e.digest.hash}/{e.digest.size_bytes}")
                status.details.add().Pack(failure)
        except Exception as e:  # the worker's own failure: report it, keep going
            if self.cancel_event.is_set():
                shutil.rmtree(staging, ignore_errors=True)
                return
            status = status_pb2.Status(
                code=code_pb2.UNKNOWN, message=f"worker {self.bot.bot_id}: {type(e).__name__}: {e}"
            )
            log(f"error {dstr(action_digest)} {arg0}: the worker failed:\n{traceback.format_exc().rstrip()}")
        shutil.rmtree(staging, ignore_errors=True)
        meta.worker_completed_timestamp.CopyFrom(now_ts())
        result.execution_metadata.CopyFrom(meta)
        lease = bots_pb2.Lease(id=self.lease_id, state=bots_pb2.LeaseState.COMPLETED, status=status)
        lease.result.Pack(result)
        status_name = code_pb2.Code.Name(status.code)
        extra = f" ({status.message})" if status.code != code_pb2.OK else ""
        log(
            f"done {dstr(action_digest)} {arg0} hint={hint or '-'} exit={exit_code} status={status_name}{extra} "
            f"{time.monotonic() - t0:.1f}s"
        )
        self.completed = lease
        self.bot.lease_done()

    # -- staging

    def _stage(self, root_digest: re_pb2.Digest, root: str) -> None:
        cas = self.bot.cas
        directories: dict[str, re_pb2.Directory] = {}
        level = [root_digest]
        while level:
            self._check_cancel()
            want = {d.hash: d for d in level if d.hash not in directories}
            blobs = cas.read_small(list(want.values()), "a Directory of the input root")
            nxt = []
            for h, data in blobs.items():
                directories[h] = re_pb2.Directory.FromString(data)
                nxt.extend(n.digest for n in directories[h].directories)
            level = nxt

        files: dict[str, tuple[re_pb2.Digest, list[tuple[str, bool]]]] = {}

        def walk(d: re_pb2.Digest, path: str) -> None:
            directory = directories[d.hash]
            for f in directory.files:
                files.setdefault(f.digest.hash, (f.digest, []))[1].append(
                    (os.path.join(path, safe_name(f.name)), f.is_executable)
                )
            for s in directory.symlinks:
                os.symlink(s.target, os.path.join(path, safe_name(s.name)))
            for sub in directory.directories:
                p = os.path.join(path, safe_name(sub.name))
                os.mkdir(p)
                walk(sub.digest, p)

        walk(root_digest, root)

        def place(digest: re_pb2.Digest, paths: list[tuple[str, bool]], data: bytes | None) -> None:
            first, _ = paths[0]
            if data is not None:
                with open(first, "wb") as f:
                    f.write(data)
            else:
                cas.read_to_file(digest, first, f"input {os.path.relpath(first, root)}")
            for p, _ in paths[1:]:
                shutil.copyfile(first, p)
            for p, executable in paths:
                os.chmod(p, 0o755 if executable else 0o644)

        small = [v for v in files.values() if v[0].size_bytes <= SMALL_BLOB]
        large = [v for v in files.values() if v[0].size_bytes > SMALL_BLOB]
        with concurrent.futures.ThreadPoolExecutor(FETCH_THREADS) as pool:
            futures = [pool.submit(place, d, paths, None) for d, paths in large]
            # Small files in batches, each batch one task.
            batch: list[tuple[re_pb2.Digest, list]] = []
            size = 0

            def fetch_batch(items: list[tuple[re_pb2.Digest, list]]) -> None:
                self._check_cancel()
                data = cas.read_small([d for d, _ in items], "an input file")
                for d, paths in items:
                    place(d, paths, data[d.hash])

            for d, paths in small:
                if batch and (size + d.size_bytes > BATCH_BYTES or len(batch) >= BATCH_COUNT):
                    futures.append(pool.submit(fetch_batch, batch))
                    batch, size = [], 0
                batch.append((d, paths))
                size += d.size_bytes
            if batch:
                futures.append(pool.submit(fetch_batch, batch))
            try:
                for fut in concurrent.futures.as_completed(futures):
                    fut.result()
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise

    # -- running

    def _execute(
        self, argv: list[str], cwd: str, env: dict[str, str], timeout: float, stdout_path: str, stderr_path: str
    ) -> tuple[int, bool]:
        if not argv:
            with open(stderr_path, "w") as f:
                f.write("worker: the Command has no arguments\n")
            open(stdout_path, "w").close()
            return 127, False
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            try:
                with self.proc_lock:
                    self._check_cancel()
                    self.process = subprocess.Popen(
                        argv,
                        cwd=cwd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,  # its own process group: a timeout or cancel kills all of it
                        close_fds=True,
                    )
            except (FileNotFoundError, PermissionError, NotADirectoryError, OSError) as e:
                err.write(f"worker: cannot run {argv[0]!r} (cwd {cwd}): {e}\n".encode())
                return (126 if isinstance(e, PermissionError) else 127), False
            deadline = time.monotonic() + timeout if timeout > 0 else None
            timed_out = False
            while True:
                try:
                    code = self.process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self.cancel_event.is_set() or (deadline is not None and time.monotonic() > deadline):
                    timed_out = not self.cancel_event.is_set()
                    kill_group(self.process)
                    code = self.process.wait()
                    break
            # Whatever the command left behind in its group (daemons) goes too.
            kill_group(self.process)
        return (code if code >= 0 else 128 - code), timed_out

    # -- outputs

    def _collect_outputs(
        self, command: re_pb2.Command, workdir: str, stdout_path: str, stderr_path: str, result: re_pb2.ActionResult
    ) -> None:
        blobs: dict[str, tuple[re_pb2.Digest, bytes | str]] = {}

        def add_file(path: str) -> re_pb2.Digest:
            d = digest_of_file(path)
            blobs.setdefault(d.hash, (d, path))
            return d

        def add_bytes(data: bytes) -> re_pb2.Digest:
            d = digest_of(data)
            blobs.setdefault(d.hash, (d, data))
            return d

        def output_file(rel: str, full: str) -> None:
            d = add_file(full)
            executable = bool(os.stat(full).st_mode & stat.S_IXUSR)
            result.output_files.add(path=rel, digest=d, is_executable=executable)

        def output_directory(rel: str, full: str) -> None:
            children: dict[str, re_pb2.Directory] = {}

            def build(path: str) -> re_pb2.Directory:
                directory = re_pb2.Directory()
                for entry in sorted(os.scandir(path), key=lambda e: e.name):
                    if entry.is_symlink():
                        directory.symlinks.add(name=entry.name, target=os.readlink(entry.path))
                    elif entry.is_dir():
                        sub = build(entry.path)
                        data = sub.SerializeToString()
                        d = digest_of(data)
                        children[d.hash] = sub
                        directory.directories.add(name=entry.name, digest=d)
                    elif entry.is_file():
                        executable = bool(entry.stat().st_mode & stat.S_IXUSR)
                        directory.files.add(name=entry.name, digest=add_file(entry.path), is_executable=executable)
                # Sorted by name within each kind (REAPI's canonical form).
                return directory

            root_dir = build(full)
            tree = re_pb2.Tree(root=root_dir, children=list(children.values()))
            tree_digest = add_bytes(tree.SerializeToString())
            # The Directory protos go to the CAS too: root_directory_digest names them (REAPI 2.3's
            # output_directory_format DIRECTORY_ONLY / TREE_AND_DIRECTORY; older clients read the Tree).
            root_digest = add_bytes(root_dir.SerializeToString())
            for child in children.values():
                add_bytes(child.SerializeToString())
            result.output_directories.add(path=rel, tree_digest=tree_digest, root_directory_digest=root_digest)

        if command.output_paths:  # REAPI v2.1+: one list, the kind is whatever the command made
            for rel in command.output_paths:
                full = os.path.join(workdir, safe_relpath(rel))
                if os.path.islink(full):
                    result.output_symlinks.add(path=rel, target=os.readlink(full))
                elif os.path.isdir(full):
                    output_directory(rel, full)
                elif os.path.isfile(full):
                    output_file(rel, full)
        else:
            for rel in command.output_files:
                full = os.path.join(workdir, safe_relpath(rel))
                if os.path.isfile(full):  # follows a symlink to its file
                    output_file(rel, full)
            for rel in command.output_directories:
                full = os.path.join(workdir, safe_relpath(rel))
                if os.path.isdir(full):
                    output_directory(rel, full)

        result.stdout_digest.CopyFrom(add_file(stdout_path))
        result.stderr_digest.CopyFrom(add_file(stderr_path))
        self.bot.cas.upload(blobs)


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------------------
# The bot session


TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
}


class Bot:
    def __init__(self, args: argparse.Namespace):
        self.instance = args.instance
        self.work_dir = os.path.abspath(args.work_dir)
        self.slots = args.slots
        self.properties = [parse_pair(p, "--property") for p in args.property]
        self.image_env = dict(parse_pair(p, "--image-env") for p in args.image_env)
        self.bot_id = args.bot_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        target = args.remote
        for scheme in ("grpc://", "http://"):
            if target.startswith(scheme):
                target = target[len(scheme) :]
        if "://" in target:
            raise SystemExit(f"worker: --remote {args.remote}: only grpc:// and http:// (plaintext) are supported")
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 30000),
        ]
        self.channel = grpc.insecure_channel(target, options=options)
        self.cas = Cas(self.channel, self.instance)
        self.bots = bots_pb2_grpc.BotsStub(self.channel)
        self.executions: dict[str, Execution] = {}
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.session: bots_pb2.BotSession | None = None

    # Called from a lease's thread when its result is ready.
    def lease_done(self) -> None:
        self.wake.set()

    def stop(self, *_: object) -> None:
        self.stopping.set()
        self.wake.set()

    def _worker_proto(self) -> worker_pb2.Worker:
        worker = worker_pb2.Worker()
        device = worker.devices.add(handle=self.bot_id)
        for k, v in self.properties:
            device.properties.add(key=k, value=v)
        worker.configs.add(key="capacity", value=str(self.slots))
        return worker

    def _leases_for_request(self) -> tuple[list[bots_pb2.Lease], set[str]]:
        leases, completed = [], set()
        for lease_id, ex in self.executions.items():
            if ex.completed is not None:
                leases.append(ex.completed)
                completed.add(lease_id)
            else:
                leases.append(bots_pb2.Lease(id=lease_id, state=bots_pb2.LeaseState.ACTIVE))
        return leases, completed

    def _apply(self, session: bots_pb2.BotSession, sent_completed: set[str]) -> bool:
        """Takes the server's view of our leases; returns whether anything changed."""
        changed = bool(sent_completed)
        for lease_id in sent_completed:
            self.executions.pop(lease_id, None)
        returned = {lease.id: lease for lease in session.leases}
        for lease_id, ex in list(self.executions.items()):
            lease = returned.get(lease_id)
            if lease is None or lease.state == bots_pb2.LeaseState.CANCELLED:
                if ex.completed is None:
                    log(f"dropped lease {lease_id}: the server cancelled or reassigned it; killing its action")
                ex.cancel()
                del self.executions[lease_id]
                changed = True
        for lease_id, lease in returned.items():
            if lease_id in self.executions or lease.state != bots_pb2.LeaseState.ACTIVE:
                continue
            ex = Execution(self, lease)
            self.executions[lease_id] = ex
            ex.start()
            changed = True
        self.session = session
        return changed

    def _create_session(self) -> None:
        backoff = 0.5
        while not self.stopping.is_set():
            request = bots_pb2.CreateBotSessionRequest(
                parent=self.instance,
                bot_session=bots_pb2.BotSession(
                    bot_id=self.bot_id, status=bots_pb2.BotStatus.OK, worker=self._worker_proto()
                ),
            )
            fut = self.bots.CreateBotSession.future(request, timeout=UPDATE_TIMEOUT)
            while not fut.done():
                if self.stopping.wait(0.1):
                    fut.cancel()
            try:
                session = fut.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                if self.stopping.is_set():
                    return
                code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.CANCELLED
                details = e.details() if isinstance(e, grpc.RpcError) else "cancelled"
                log(f"retry: CreateBotSession failed ({code.name}: {details}); retrying in {backoff:.1f}s")
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            log(
                f"session {session.name} (bot {self.bot_id}, slots {self.slots}, properties "
                f"{dict(self.properties)}, work dir {self.work_dir})"
            )
            self._apply(session, set())
            return

    def run(self) -> None:
        os.makedirs(self.work_dir, exist_ok=True)
        self._create_session()
        backoff = 0.5
        while not self.stopping.is_set():
            assert self.session is not None
            self.wake.clear()
            leases, sent_completed = self._leases_for_request()
            session = bots_pb2.BotSession()
            session.CopyFrom(self.session)
            del session.leases[:]
            session.leases.extend(leases)
            session.status = bots_pb2.BotStatus.OK
            session.worker.CopyFrom(self._worker_proto())
            t0 = time.monotonic()
            fut = self.bots.UpdateBotSession.future(
                bots_pb2.UpdateBotSessionRequest(name=session.name, bot_session=session), timeout=UPDATE_TIMEOUT
            )
            # A lease finishing (or a signal) cuts a long-poll short: its result goes out at once.
            interrupted = False
            while not fut.done():
                if self.wake.wait(0.1):
                    interrupted = fut.cancel()
                    break
            if interrupted:
                continue
            try:
                response = fut.result()
            except grpc.FutureCancelledError:
                continue
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    break
                if e.code() in TRANSIENT:
                    log(f"retry: UpdateBotSession failed ({e.code().name}: {e.details()}); retrying in {backoff:.1f}s")
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                # The server no longer knows this session (it expired, or was replaced): its jobs were requeued.
                log(f"session lost ({e.code().name}: {e.details()}); killing running actions, new session")
                for ex in self.executions.values():
                    ex.cancel()
                self.executions.clear()
                self._create_session()
                continue
            backoff = 0.5
            changed = self._apply(response, sent_completed)
            running = sum(1 for ex in self.executions.values() if ex.completed is None)
            if running >= self.slots:
                # Full: the server answers at once, so pace the heartbeats (well inside the keepalive).
                utc = datetime.timezone.utc
                remaining = response.expire_time.ToDatetime(tzinfo=utc) - datetime.datetime.now(utc)
                self.wake.wait(max(0.5, min(5.0, remaining.total_seconds() / 3)))
            elif not changed and time.monotonic() - t0 < 0.5:
                # The server did not long-poll (short keepalive): do not spin.
                self.wake.wait(1.0)
        self._shutdown()

    def _shutdown(self) -> None:
        log("stopping: killing running actions, handing their leases back")
        for ex in self.executions.values():
            ex.cancel()
        for ex in self.executions.values():
            ex.thread.join(timeout=10)
        if self.session is None:
            return
        session = bots_pb2.BotSession()
        session.CopyFrom(self.session)
        del session.leases[:]
        for lease_id, ex in self.executions.items():
            if ex.completed is not None:
                session.leases.append(ex.completed)
            else:
                session.leases.add(
                    id=lease_id,
                    state=bots_pb2.LeaseState.COMPLETED,
                    status=status_pb2.Status(code=code_pb2.UNAVAILABLE, message=f"worker {self.bot_id} stopped"),
                )
        session.status = bots_pb2.BotStatus.BOT_TERMINATING
        try:
            self.bots.UpdateBotSession(
                bots_pb2.UpdateBotSessionRequest(name=session.name, bot_session=session), timeout=5
            )
        except grpc.RpcError as e:
            log(f"error: the final UpdateBotSession failed ({e.code().name}: {e.details()})")
        self.channel.close()


def parse_pair(text: str, flag: str) -> tuple[str, str]:
    if "=" not in text:
        raise SystemExit(f"worker: {flag} {text!r}: expected KEY=VALUE")
    k, v = text.split("=", 1)
    return k, v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remote", required=True, help="grpc://HOST:PORT of the Bots/CAS/ByteStream server")
    parser.add_argument("--instance", default="", help='instance name (default: "")')
    parser.add_argument("--work-dir", required=True, help="where each action's input root is staged")
    parser.add_argument("--slots", type=int, default=1, help="leases run at once (default 1)")
    parser.add_argument(
        "--property", action="append", default=[], metavar="KEY=VALUE", help="a device property (e.g. OSFamily=linux)"
    )
    parser.add_argument(
        "--image-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of the (imitated) container image; the Command's own variables win",
    )
    parser.add_argument("--log", help="append the log here instead of stderr")
    parser.add_argument(
        "--bot-id",
        help="the bot's id (default: HOST-PID-RANDOM). A new session with the id of a dead one requeues its "
        "leases at once instead of after the keepalive",
    )
    args = parser.parse_args()
    if args.slots < 1:
        parser.error("--slots must be at least 1")
    global LOG_FILE
    if args.log:
        LOG_FILE = open(args.log, "a", buffering=1)
    bot = Bot(args)
    signal.signal(signal.SIGTERM, bot.stop)
    signal.signal(signal.SIGINT, bot.stop)
    bot.run()
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
