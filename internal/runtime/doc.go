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
// result.json once it ended. An exec id runs at most once per sandbox;
// asking again returns the journal.
//
// # The backend seam
//
//	worker ─ backend.Registry (runtime.Backends: names, Available)
//	  │
//	Sandbox: layers held (package lower), upper's storage (package disk),
//	  │      state.json, policy compiled, journal, cgroup limits/figures
//	  │
//	driver (driver_linux.go): newID · start(rootfs as []mount.Mount) ·
//	  │                       attach · teardown  + ability: files
//	  │
//	backend.Instance: Exec · Result · Probe · Done · Close · Destroy
//	  │              + abilities: Restricter, Protecter, Renamer
//	  ├── container: a dsec-init as pid 1 of new namespaces, on an overlay
//	  │              of the host's layer mounts (package container)
//	  └── microvm:   next (a QEMU guest whose agent is the same init)
//
// A Sandbox does what every kind of sandbox needs; its driver does what
// only its backend does (driver_linux.go lists the drivers, once). The
// Sandbox describes the root, as data: the overlay of its layers' host
// mounts under its upper; the container driver mounts it, idmapped
// into the sandbox's user namespace where it has one
// (mount.Mount.MountIDMapped).
//
// Abilities are found by type assertion, and a backend without one
// gets a typed not-implemented error that names it: on the instance
// (restrict, protect paths, set the host name) or on the driver (files,
// for copies in and out: backend.Files, a container's reached from the
// host). What acts on the sandbox's cgroup is the Sandbox's, for every
// backend, since every backend's processes live in it: freezing (pause,
// a consistent pack-diff), limits and their live update, figures
// (memory, CPU, OOM kills) and reclaim. So is the upper: its storage is
// the Sandbox's (package disk), which pack-diff reads with the sandbox
// frozen. A backend whose writes pass through a cache of its own (a
// VM's page cache) adds an ability to flush it before a pack, and one to
// reclaim its memory its own way (a balloon), when it comes. Every
// backend's processes live in a cgroup the Sandbox bounds and reads:
// a container's init and commands, a VM's hypervisor. What every
// backend must do, seen through the worker's API, is the conformance
// suite in package backendtest. FnCall pools, spare inits and primed
// sandboxes are ways of using a backend, not backends: pools of package
// warm. Layer mounts, the exec journal, NAT, user namespace id ranges
// and the host-wide slot table of the last two are packages lower,
// journal, network, idmap and hostslot.
//
// The host worker that owns sandboxes and serves the API is package
// worker.
package runtime
