package policy

import (
	"fmt"
	"slices"

	"github.com/containerd/errdefs"
	"github.com/elastic/go-seccomp-bpf/arch"
)

// The seccomp profile is an allowlist for the native architecture: a
// system call not on it fails with EPERM; another architecture's entry
// (i386 int 0x80, x32) kills the process. go-seccomp-bpf assembles the
// name lists. Its argument conditions compare all 64 bits of a register
// while the kernel reads int arguments (an ioctl's request, a socket's
// family) from the low 32 only, so garbage in the high half would slip
// past them: the argument checks are ours, ahead of its program, and
// compare the low 32 bits.

// allowed is the allowlist: Docker's default profile, less what a
// sandbox never needs and what Denied names.
var allowed = []string{
	"accept", "accept4", "access", "alarm", "arch_prctl", "bind", "brk", "cachestat", "capget", "capset", "chdir",
	"chmod", "chown", "chroot", "clock_getres", "clock_gettime", "clock_nanosleep", "clone", "close", "close_range",
	"connect", "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl",
	"epoll_pwait", "epoll_pwait2", "epoll_wait", "eventfd", "eventfd2", "execve", "execveat", "exit", "exit_group",
	"faccessat", "faccessat2", "fadvise64", "fallocate", "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown",
	"fchownat", "fcntl", "fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr", "fsetxattr",
	"fstat", "fstatfs", "fsync", "ftruncate", "futex", "futex_requeue", "futex_wait", "futex_waitv", "futex_wake",
	"futimesat", "get_mempolicy", "get_robust_list", "get_thread_area", "getcpu", "getcwd", "getdents",
	"getdents64", "getegid", "geteuid", "getgid", "getgroups", "getitimer", "getpeername", "getpgid", "getpgrp",
	"getpid", "getppid", "getpriority", "getrandom", "getresgid", "getresuid", "getrlimit", "getrusage", "getsid",
	"getsockname", "getsockopt", "gettid", "gettimeofday", "getuid", "getxattr", "getxattrat", "inotify_add_watch",
	"inotify_init", "inotify_init1", "inotify_rm_watch", "io_cancel", "io_destroy", "io_getevents", "io_pgetevents",
	"io_setup", "io_submit", "ioctl", "ioprio_get", "ioprio_set", "kill", "landlock_add_rule",
	"landlock_create_ruleset", "landlock_restrict_self", "lchown", "lgetxattr", "link", "linkat", "listen",
	"listxattr", "listxattrat", "llistxattr", "lremovexattr", "lseek", "lsetxattr", "lsm_get_self_attr",
	"lsm_list_modules", "lstat", "madvise", "map_shadow_stack", "mbind", "membarrier", "memfd_create", "mincore",
	"mkdir", "mkdirat", "mknod", "mknodat", "mlock", "mlock2", "mlockall", "mmap", "mprotect", "mq_getsetattr",
	"mq_notify", "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink", "mremap", "mseal", "msgctl", "msgget",
	"msgrcv", "msgsnd", "msync", "munlock", "munlockall", "munmap", "nanosleep", "newfstatat", "open", "openat",
	"openat2", "pause", "personality", "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc",
	"pkey_free", "pkey_mprotect", "poll", "ppoll", "prctl", "pread64", "preadv", "preadv2", "prlimit64",
	"process_mrelease", "pselect6", "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink",
	"readlinkat", "readv", "recvfrom", "recvmmsg", "recvmsg", "remap_file_pages", "removexattr", "removexattrat",
	"rename", "renameat", "renameat2", "restart_syscall", "rmdir", "rseq", "rt_sigaction", "rt_sigpending",
	"rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "rt_tgsigqueueinfo",
	"sched_get_priority_max", "sched_get_priority_min", "sched_getaffinity", "sched_getattr", "sched_getparam",
	"sched_getscheduler", "sched_rr_get_interval", "sched_setaffinity", "sched_setattr", "sched_setparam",
	"sched_setscheduler", "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop",
	"sendfile", "sendmmsg", "sendmsg", "sendto", "set_mempolicy", "set_mempolicy_home_node", "set_robust_list",
	"set_thread_area", "set_tid_address", "setfsgid", "setfsuid", "setgid", "setgroups", "setitimer", "setpgid",
	"setpriority", "setregid", "setresgid", "setresuid", "setreuid", "setrlimit", "setsid", "setsockopt",
	"setuid", "setxattr", "setxattrat", "shmat", "shmctl", "shmdt", "shmget", "shutdown", "sigaltstack",
	"signalfd", "signalfd4", "socket", "socketpair", "splice", "stat", "statfs", "statx", "symlink", "symlinkat",
	"sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time", "timer_create", "timer_delete",
	"timer_getoverrun", "timer_gettime", "timer_settime", "timerfd_create", "timerfd_gettime", "timerfd_settime",
	"times", "tkill", "truncate", "umask", "uname", "unlink", "unlinkat", "unshare", "utime", "utimensat",
	"utimes", "vfork", "vmsplice", "wait4", "waitid", "write", "writev",
}

// Denied are the system calls no sandbox may make, whatever its policy:
// they are not on the allowlist, and a test checks they never get there.
var Denied = []string{
	// The mount API.
	"mount", "umount2", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "open_tree_attr",
	"mount_setattr", "pivot_root", "listmount", "statmount",
	// Namespaces (clone and unshare with namespace flags: see argRules).
	"setns",
	// Other processes' memory, the kernel's insides.
	"ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp", "bpf",
	"perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
	"io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
	"open_by_handle_at", "name_to_handle_at", "swapon", "swapoff", "acct", "syslog", "reboot", "quotactl",
	"quotactl_fd", "lookup_dcookie", "fanotify_init", "fanotify_mark", "iopl", "ioperm", "settimeofday",
	"clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vhangup", "nfsservctl",
	"uselib", "modify_ldt", "memfd_secret", "uretprobe",
}

// initNeeds are what the sandbox's init (whose thread carries the
// filter its commands inherit) needs itself: a policy cannot deny them.
var initNeeds = []string{
	"accept4", "clone", "close", "epoll_ctl", "epoll_pwait", "execve", "exit", "exit_group", "fcntl", "futex",
	"getpid", "gettid", "madvise", "mmap", "munmap", "nanosleep", "newfstatat", "openat", "read", "recvmsg",
	"rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sched_yield", "sendmsg", "sigaltstack", "tgkill", "wait4",
	"write", "fstat", "getrandom", "mprotect", "close_range", "prctl", "setsid", "ioctl", "dup2", "dup3", "chdir",
}

func nativeArch() (*arch.Info, error) {
	a, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("seccomp on this architecture: %v: %w", err, errdefs.ErrNotImplemented)
	}
	return a, nil
}

func checkDeny(name string) error {
	a, err := nativeArch()
	if err != nil {
		return err
	}
	if _, ok := a.SyscallNames[name]; !ok {
		return fmt.Errorf("%q is no system call on %s", name, a.Name)
	}
	if slices.Contains(initNeeds, name) {
		return fmt.Errorf("%q: the sandbox's init needs it to start and reap commands; it cannot be denied", name)
	}
	return nil
}
