// Package policy parses sandbox policy documents (api.Policy) and turns
// them into what the kernel enforces: a seccomp allowlist program
// (Seccomp), Landlock rules for files, and an egress allowlist
// (Allowlist) held by cgroup BPF programs on the sandbox's cgroup2
// directory (ApplyNetwork).
//
// A policy's sections differ in what they can reach. The network
// allowlist is a map the kernel consults on every connect and sendmsg:
// it changes at once for every process, either way. Seccomp filters and
// Landlock domains belong to a process and what it starts later; they
// can be added to, never removed, so a policy applied to a running
// sandbox tightens them for the processes started from then on
// (Tightens refuses a loosening), and processes already running keep
// what they had.
package policy
