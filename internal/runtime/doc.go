// Package runtime owns a sandbox's lifecycle on a host: its layers
// mounted (from the local store, or lazily from a remote), composed with
// overlay under a writable upper of its own, a cgroup, and an init
// (package container) in new namespaces; stop and start on the same
// files; removal without leftovers; re-adoption by a new worker.
//
// Every command runs under an exec id and is journaled in
// <root>/sandboxes/NAME/execs/ID/: the output files the command writes
// to directly (so output survives the worker) and result.json once it
// ended. An id runs at most once per sandbox; asking again returns the
// journal. States: creating (a worker died making it: recovery removes
// it), running, stopped (files kept, no process), dead (its init died).
//
// The host worker that owns sandboxes and serves the API is package
// worker. It finds a sandbox's backend by name in its registry (package
// backend, listed in worker.Backends) and records it in the sandbox's
// state: container (package container) for now, a QEMU microVM next.
// FnCall pools, spares and primed sandboxes are ways of using a backend,
// not backends.
package runtime
