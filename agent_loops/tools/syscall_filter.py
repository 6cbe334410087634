"""The python sandbox's system-call filter: what model-written code never needs, refused (EPERM).

Built with libseccomp (the maintained C library every container runtime uses; `pyseccomp` is its
ctypes binding, API-compatible with libseccomp's own Python module) and handed to bubblewrap as
compiled BPF (`bwrap --seccomp FD`), which installs it just before the sandbox's first program runs.

A deny list over a default of allow, like Docker's default profile: an allow list would have to
follow every syscall a Python release, glibc or a /usr program starts to use. What it refuses is
kernel attack surface that RL-generated code has no use for: asynchronous I/O rings and legacy AIO,
userfaultfd, memory outside the address-space limit (SysV IPC, memfd), keyrings (shared by every
process of a uid), new namespaces (in which code would hold every capability), raw / packet /
netlink / vsock and IP sockets (socket and socketpair: AF_UNIX alone, its buffers at the host's
default), execution domains, tracing, mounts, kernel modules, BPF, perf events, and the clock /
reboot / swap / quota calls. `clone3`
answers ENOSYS, because its flags sit behind a pointer a filter cannot read; glibc then falls back
to `clone`, whose namespace flags are checked. System calls of another ABI (i386, x32) kill the
process (libseccomp's bad-architecture action).
"""

from __future__ import annotations

import errno
import functools
import tempfile

# Refused whatever their arguments.
DENIED = (
    # asynchronous I/O rings and userfaultfd: the kernel's most exploited interfaces of recent years;
    # the legacy AIO table, host-wide (one call could fill all of fs.aio-max-nr)
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "io_setup", "io_submit",
    # memory no process limit counts: SysV segments outlive their creator in the call's IPC namespace;
    # memfd files are not address space (RLIMIT_AS), only mapped views of them are
    "shmget", "msgget", "semget", "memfd_create", "memfd_secret",
    # keyrings: per uid, not per call, so a channel between calls
    "add_key", "request_key", "keyctl",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # the kernel itself
    "init_module", "finit_module", "delete_module", "bpf", "perf_event_open", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "iopl", "ioperm", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "lookup_dcookie", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init", "vhangup", "uselib",
)
# clone() flags that create a namespace (linux/sched.h): each refused on its own.
CLONE_NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                         0x40000000)  # NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
# Socket families allowed: AF_UNIX (1) alone (asyncio's and multiprocessing's socketpairs); in the
# sandbox's network namespace an IP socket reaches nothing but itself, and a TCP pair on its loopback
# pins up to ~8 MiB of kernel buffers outside RLIMIT_AS (60 sockets: 470 MiB under memory_mb=128).
# Every other family (AF_INET 2, AF_INET6 10, netlink 16, packet 17, vsock 40, ...) is refused, and
# socketpair() (which reaches each family's create code too) for any family but AF_UNIX.
ALLOWED_SOCKET_FAMILIES = (1,)
AF_UNIX = 1
# setsockopt(SOL_SOCKET, ...) options that grow a socket's buffers past the host's default
# (net.core.wmem_default, 208 KiB): SO_SNDBUF 7, SO_RCVBUF 8, SO_SNDBUFFORCE 32, SO_RCVBUFFORCE 33. With
# RLIMIT_NOFILE 64, a sandboxed process pins at most ~64 x 208 KiB (13 MiB) in AF_UNIX queues.
SOL_SOCKET = 1
BUFFER_OPTIONS = (7, 8, 32, 33)
MAX_SOCKET_FAMILY = 64
SOCKET_TYPE_MASK, SOCK_RAW, SOCK_PACKET = 0xF, 3, 10
# personality(): only the default execution domain (PER_LINUX); a filter cannot also allow the query
# value 0xffffffff (libseccomp takes one comparison per argument and rule, and no allow rule beside a
# default of allow), and nothing a code tool runs asks for it.
PER_LINUX = 0


class FilterUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing on this host."""


def _libseccomp():
    try:
        import seccomp  # libseccomp's own binding, where the distribution ships it
    except ImportError:
        try:
            import pyseccomp as seccomp
        except ImportError as e:
            raise FilterUnavailable("the python sandbox's system-call filter needs the `pyseccomp` package "
                                    "(pip install pyseccomp; setup.py declares it)") from e
    return seccomp


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter (classic BPF for this machine's architecture), built once per process."""
    sc = _libseccomp()
    try:
        f = sc.SyscallFilter(sc.ALLOW)
    except (OSError, RuntimeError, AttributeError) as e:  # pyseccomp raises on a missing libseccomp.so.2
        raise FilterUnavailable(f"libseccomp cannot be loaded ({e}): install it (Debian/Ubuntu: apt-get install "
                                "libseccomp2; scripts/setup_venv.sh does this as root)") from e
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        f.add_rule(deny, name)
    for flag in CLONE_NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for family in range(MAX_SOCKET_FAMILY):
        if family not in ALLOWED_SOCKET_FAMILIES:
            f.add_rule(deny, "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(deny, "socket", sc.Arg(0, sc.GE, MAX_SOCKET_FAMILY))
    f.add_rule(deny, "socketpair", sc.Arg(0, sc.NE, AF_UNIX))
    for option in BUFFER_OPTIONS:
        f.add_rule(deny, "setsockopt", sc.Arg(1, sc.EQ, SOL_SOCKET), sc.Arg(2, sc.EQ, option))
    for kind in (SOCK_RAW, SOCK_PACKET):
        f.add_rule(deny, "socket", sc.Arg(1, sc.MASKED_EQ, SOCKET_TYPE_MASK, kind))
    f.add_rule(deny, "personality", sc.Arg(0, sc.NE, PER_LINUX))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()
