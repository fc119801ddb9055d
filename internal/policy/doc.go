// Package policy will parse policy documents and enforce them with
// Landlock, seccomp and cgroup eBPF. Nothing is here yet; see the policy
// issue.
package policy
