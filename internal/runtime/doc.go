// Package runtime owns a sandbox's lifecycle on a host: its layers
// mounted (from the local store, or lazily from a remote), composed with
// overlay under a writable upper of its own, a cgroup, and an init
// (package container) in new namespaces; stop and start on the same
// files; removal without leftovers; re-adoption by a new worker.
//
// # Lifecycle
//
//	           Create                      Stop
//	(none) ──▶ creating ──▶ running ─────────────▶ stopped
//	              │            │  ▲                   │
//	   a worker   │   its init │  └───── Start ───────┘
//	   died: Load │       died ▼                      │
//	   removes it └──▶ (none)  dead ──── Start ──▶ running
//	                           any ──── Remove ──▶ (none)
//
// A running sandbox survives its worker: Load re-attaches it, and
// collects the results of the commands the dead worker left running.
//
// # One description, one identity
//
// A sandbox is described once: a Spec, as a create asks for it in
// Options and as the create resolved it in State (state.json), which
// also holds what starting it made. Its ID, chosen when it is made and
// never changed, names its directory <root>/sandboxes/ID, its cgroup and
// the user its layers are held by; its name is a label, the link
// <root>/names/NAME (ident_linux.go). A primed sandbox is one without a
// name yet: a create that takes it writes its state and its name, and
// moves nothing.
//
// Every command runs under an exec id and is journaled in
// <root>/sandboxes/ID/execs/EXEC/ (package journal): the output files
// the command writes to directly (so output survives the worker) and
// result.json once it ended, its result also a synced line of
// <root>/sandboxes/ID/results.log. An exec id runs at most once per
// sandbox; asking again returns the journal.
//
// # The backend seam
//
//	worker ─ Drivers (drivers_linux.go: each driver built with its
//	  │      configuration, once; a registry of package backend)
//	  │
//	Sandbox: layers held (package lower), upper's storage (package disk),
//	  │      state.json, policy compiled, journal, cgroup limits/figures,
//	  │      egress (resolver, fast path), the group killed and removed
//	  │
//	driver.Driver: Start(StartSpec) → Started · Attach(Handle) ·
//	  │            Teardown(Handle)
//	  │   + abilities: ImageUpper, WarmPauser, Prestarter, UpperHolder,
//	  │     FileOpener, MemorySnapshotter, BaseResolver, DiskSnapshotter,
//	  │     SocketCloser
//	  │
//	backend.Instance: Exec · Result · Probe · Done · Close · Destroy
//	  │   + abilities: Restricter, Protecter, Renamer, Signaler,
//	  │     driver.FSFreezer, driver.MemoryReporter
//	  ├── container (package driver/containers): a dsec-init as pid 1 of
//	  │             new namespaces, on an overlay of the host's layer
//	  │             mounts (package container), spare inits made ahead
//	  ├── microvm   (package driver/microvms): a QEMU guest whose agent is
//	  │             the same init, reached through its shim
//	  └── vm        (package driver/vms): a full VM booted through
//	                firmware from its own disk image (a BaseResolver:
//	                no layers), the same agent as a systemd service;
//	                its snapshots block diffs (a DiskSnapshotter)
//
// A Sandbox does what every kind of sandbox needs; its driver, a package
// outside this one, does what only its backend does. A driver is given
// a StartSpec (the root as []mount.Mount, the layers' images, limits,
// the group's name, restrictions, the policy's paths, the egress
// allowlist, whether it has a network) and a Handle of what the state
// recorded; it returns what it started (the Instance, the group, the
// pid, and a Record the state keeps). It never sees a Sandbox. A backend
// of a test's own is one more driver in DriverConfig.Extra (the sdk
// tests' plain backend passes the conformance suite so).
//
// Abilities are found by type assertion, and a backend without one
// gets a typed not-implemented error that names it: on the instance
// (restrict, protect paths, set the host name) or on the driver (files,
// for copies in and out: backend.Files, a container's reached from the
// host). The runtime never compares backend names. What acts on the
// sandbox's cgroup is the Sandbox's, for every backend, since every
// backend's processes live in it: freezing (pause, a consistent
// pack-diff), limits and their live update, figures (memory, CPU, OOM
// kills) and reclaim. So is the upper: its storage is the Sandbox's
// (package disk), which pack-diff reads with the sandbox frozen, or,
// where the backend holds it (a guest's disk image), through its
// UpperHolder. What every backend must do, seen through the worker's
// API, is the conformance suite in package backendtest. FnCall pools,
// spare inits and primed sandboxes are ways of using a backend, not
// backends: pools of package warm. Layer mounts, the exec journal, NAT,
// user namespace id ranges and the host-wide slot table of the last two
// are packages lower, journal, network, idmap and hostslot.
//
// The host worker that owns sandboxes and serves the API is package
// worker.
package runtime
