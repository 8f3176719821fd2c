#!/usr/bin/python3
"""Runs the README's shell recipes exactly as written, against the real mrd.

The README's "A round trip with mrctl", "grpcurl recipes" and "Python
client" blocks assume
mrd runs as root with its defaults: sockets in /run/mrd, files under
/dev/shm/mrd, peers on 127.0.0.1:7471, metrics on 127.0.0.1:9464. So the test
gives them exactly that, privately: it re-runs itself in new mount and
network namespaces (unshare; needs root, as CI is), mounts fresh tmpfs on
/run and /dev/shm there, brings up a loopback of its own and starts
`mrd --device=software` (what `make run` runs).

The "Two nodes" block starts its own etcd (Debian's etcd-server) and two
mrd of its own, beside that one; the "Several devices" block one mrd of its
own on two software devices. Each block then runs line by line in one bash, in a directory where
`build/client/mrctl/mrctl` is the mrctl under test, with the `grpcurl` of
tests/support/grpcurl.cc (reflection only, as grpcurl) first on PATH. A
command must exit 0 unless the README says otherwise; a `# → TEXT` comment,
at the end of a command's line or on the line after it, is what the
command prints (`...` stands for anything; `(exit N)` is its exit code).
The Python block runs with the tree's Python client. The grpcurl block's
placeholders are filled in as a reader would: `<token>`
with the session OpenLeaseSession returned, `<id>` with the buffer
ImportFile returned.

Usage: readme_test.py SOURCE_DIR MRD MRCTL GRPCURL_DIR PYTHON_GEN_DIR
Exit 0: every command did what the README says; 77: not root (skipped).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def block_after(readme, heading):
    """The first ```sh block after `heading`."""
    at = readme.index(heading)
    start = readme.index("```sh\n", at) + len("```sh\n")
    return readme[start:readme.index("```", start)]


def commands(block):
    """(command, expected output or None) pairs; continuation lines and here
    documents joined, comment lines dropped (a `# → ` line belongs to the
    command before; inside a here document it is the whole command's)."""
    out = []
    pending = ""
    heredoc_end = None
    for line in block.splitlines():
        if heredoc_end is not None:
            pending += "\n" + line
            if line.strip() == heredoc_end:
                m = re.search(r"#\s→\s(.*)$", pending, re.M)
                out.append((pending, m.group(1).strip() if m else None))
                pending = ""
                heredoc_end = None
            continue
        m = re.search(r"<<-?'?(\w+)'?", line)
        if m and not line.lstrip().startswith("#"):
            heredoc_end = m.group(1)
            pending = (pending + "\n" + line) if pending else line
            continue
        if pending:
            line = pending + "\n" + line
            pending = ""
        if line.endswith("\\"):
            pending = line
            continue
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("# → "):
            cmd, _ = out[-1]
            out[-1] = (cmd, stripped[len("# → "):])
            continue
        if stripped.startswith("#"):
            continue
        expected = None
        m = re.search(r"\s#\s→\s(.*)$", line)
        if m:
            expected = m.group(1)
            line = line[:m.start()]
        out.append((line.rstrip(), expected))
    return out


class Shell:
    """One bash, fed a line at a time; returns each line's output and code."""

    MARK = "@@readme-test-done@@"

    def __init__(self, cwd, env):
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-s"], cwd=cwd, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.run("shopt -s expand_aliases")

    def run(self, line, timeout=60):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.write('printf "\\n%s %d\\n" ' + self.MARK + " $?\n")
        self.proc.stdin.flush()
        out = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = self.proc.stdout.readline()
            if not got:
                break
            if got.startswith(self.MARK + " "):
                text = "".join(out)
                if text.endswith("\n"):
                    text = text[:-1]  # the marker's own newline
                return text, int(got.split()[1])
            out.append(got)
        return "".join(out), -1

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def matches(expected, output, code):
    """Whether `output`/`code` is what a `# → ` comment says."""
    want_code = 0
    m = re.search(r"\s*\(exit (\d+)\)$", expected)
    if m:
        want_code = int(m.group(1))
        expected = expected[:m.start()]
    if code != want_code:
        return False
    at = 0
    for part in expected.split("..."):
        part = part.strip()
        found = output.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def run_block(shell, name, block, fill=None):
    for cmd, expected in commands(block):
        if fill:
            cmd = fill(cmd)
        output, code = shell.run(cmd)
        shown = cmd.replace("\n", " ")
        if expected is None:
            check(code == 0, "%s: %s (exit %d)%s" % (
                name, shown, code, "" if code == 0 else "\n" + output))
        else:
            check(matches(expected, output, code),
                  "%s: %s → %s (printed %r, exit %d)" % (
                      name, shown, expected, output, code))
        yield cmd, output, code


def inside(src, mrd, mrctl, grpcurl_dir, python_gen):
    # Fresh /run and /dev/shm, our own loopback.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs",
                    "/run"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs",
                    "/dev/shm"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

    work = tempfile.mkdtemp(prefix="mrd-readme-")
    os.makedirs(os.path.join(work, "build", "client", "mrctl"))
    os.symlink(mrctl, os.path.join(work, "build", "client", "mrctl",
                                   "mrctl"))
    # The two-node recipe starts build/server/mrd itself.
    os.makedirs(os.path.join(work, "build", "server"))
    os.symlink(mrd, os.path.join(work, "build", "server", "mrd"))
    # The Python client's recipe: build/client/python/gen, client/python.
    os.makedirs(os.path.join(work, "build", "client", "python"))
    os.symlink(python_gen, os.path.join(work, "build", "client", "python",
                                        "gen"))
    os.makedirs(os.path.join(work, "client"))
    os.symlink(os.path.join(src, "client", "python"),
               os.path.join(work, "client", "python"))
    log = open(os.path.join(work, "mrd.log"), "w")
    server = subprocess.Popen([mrd, "--device=software"], stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            if os.path.exists("/run/mrd/mrd.sock") or server.poll() is not None:
                break
            time.sleep(0.05)
        check(os.path.exists("/run/mrd/mrd.sock"),
              "mrd --device=software listens on /run/mrd/mrd.sock")
        if failures:
            return

        with open(os.path.join(src, "README.md")) as f:
            readme = f.read()
        env = dict(os.environ)
        env["PATH"] = grpcurl_dir + ":" + env["PATH"]
        env.pop("MRD_SESSION", None)
        shell = Shell(work, env)

        mrctl_block = block_after(readme, "## A round trip with mrctl")
        cmds = list(run_block(shell, "mrctl", mrctl_block))
        check(len(cmds) >= 12, "the mrctl round trip has its %d commands" %
              len(cmds))

        values = {}

        def fill(cmd):
            for key, value in values.items():
                cmd = cmd.replace(key, value)
            return cmd

        grpcurl_block = block_after(readme, "## grpcurl recipes")
        ran = []
        for cmd, output, code in run_block(shell, "grpcurl", grpcurl_block,
                                           fill):
            ran.append((cmd, output, code))
            if code != 0 or not output.startswith("{"):
                continue
            reply = json.loads(output)
            if "OpenLeaseSession" in cmd:
                values["<token>"] = reply.get("session", "")
            elif "ImportFile" in cmd:
                values["<id>"] = reply.get("buffer", "")
        # Two nodes: the recipe starts its own etcd and two mrd (their own
        # runtime and shm directories, ports picked free, no metrics).
        two_nodes = block_after(readme, "## Two nodes")
        cmds = list(run_block(shell, "two nodes", two_nodes))
        check(len(cmds) >= 15, "the two-node recipe has its %d commands" %
              len(cmds))
        # Several devices: the recipe starts its own mrd on two software
        # devices (its own runtime and shm directories, ports picked free).
        several = block_after(readme, "## Several devices")
        cmds = list(run_block(shell, "several devices", several))
        check(len(cmds) >= 17, "the several-device recipe has its %d "
              "commands" % len(cmds))
        python_block = block_after(readme, "## Python client")
        cmds = list(run_block(shell, "python", python_block))
        check(len(cmds) == 2, "the Python recipe is its 2 commands")
        shell.close()

        def output_of(fragment):
            for cmd, output, _ in ran:
                if fragment in cmd:
                    return output
            return ""

        listed = output_of(" list").split()
        check({"mrd.v1.MemoryRegistration", "grpc.health.v1.Health",
               "grpc.reflection.v1alpha.ServerReflection"} <= set(listed),
              "list names mrd's service, health and reflection: %s" % listed)
        check("rpc RegisterMr ( .mrd.v1.RegisterMrRequest ) returns "
              "( .mrd.v1.RegisterMrResponse );" in
              output_of("describe mrd.v1.MemoryRegistration.RegisterMr"),
              "describe shows RegisterMr's signature")
        health = [json.loads(o) for c, o, code in ran
                  if "Health/Check" in c and code == 0]
        check(health == [{"status": "SERVING"}] * 2,
              "health answers SERVING for \"\" and for the service name: %s"
              % health)
        info = output_of("/GetDeviceInfo")
        check('"kind": "software"' in info, "GetDeviceInfo: the software "
              "device")
        check(values.get("<token>") and values.get("<id>"),
              "the lease session and the imported buffer came back")
        reg = output_of("/RegisterMr")
        check('"rkey"' in reg and '"references": 1' in reg,
              "RegisterMr returned a token, one reference: %s" % reg)
        listing = output_of("/ListRegistrations")
        registration = json.loads(reg).get("registration", "?") if (
            reg.startswith("{")) else "?"
        check('"%s"' % registration in listing,
              "ListRegistrations lists registration %s" % registration)
    finally:
        server.terminate()
        try:
            rc = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            rc = -1
        log.close()
        with open(os.path.join(work, "mrd.log")) as f:
            mrd_log = f.read()
        check(rc == 0 and "pinned bytes: 0" in mrd_log,
              "mrd stops on SIGTERM with exit 0 and nothing pinned")
        if failures:
            print("---- mrd log ----\n" + mrd_log + "---- end ----")
        shutil.rmtree(work, ignore_errors=True)


def main():
    src, mrd, mrctl, grpcurl_dir, python_gen = sys.argv[1:6]
    if os.environ.get("MRD_README_TEST_INSIDE") != "1":
        if os.geteuid() != 0:
            print("SKIP: the README's recipes need root (mrd's defaults, in "
                  "private mount and network namespaces)")
            return 77
        os.environ["MRD_README_TEST_INSIDE"] = "1"
        os.execvp("unshare", ["unshare", "--mount", "--net",
                              "--propagation", "private", sys.executable,
                              os.path.abspath(__file__), src,
                              os.path.abspath(mrd), os.path.abspath(mrctl),
                              os.path.abspath(grpcurl_dir),
                              os.path.abspath(python_gen)])
    inside(src, mrd, mrctl, grpcurl_dir, python_gen)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
