package runtime

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/idmap"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// The backend seam. A Sandbox does what every kind of sandbox needs:
// its layers found and held, its upper's storage, its state, its policy
// compiled, the journal of its steps, its group's limits and figures. A
// driver does the rest, what only its backend does: start the sandbox's
// instance (a container's init on an overlay of the host's layer
// mounts), find it again after a worker restart, and take down what it
// made. The drivers are registered here, once (Backends), and the worker
// serves from that registry.
type driver interface {
	backend.Backend
	// newID is the ID of sb, a sandbox about to be made (its state as
	// its create resolved it): a warm instance's made ahead for it, which
	// newID puts in sb.prestarted for start to take, or a new one.
	newID(sb *Sandbox, m Mounter) string
	// start starts sb's instance: it sets sb.c and sb.Pid, and sb.g, the
	// group every process of the sandbox runs in, held to sb.Allowlist
	// before anything of the sandbox runs; and what sb's state keeps for
	// attach and teardown (CgroupName, IDs, NAT). On an error teardown
	// undoes what it did.
	start(ctx context.Context, sb *Sandbox, m Mounter, s startSpec) error
	// attach finds a running sandbox's instance again (a worker
	// restarted): sb.g, and sb.c unless the instance is gone (sb.c nil:
	// it died while no worker was there).
	attach(sb *Sandbox) error
	// teardown kills every process of the sandbox and removes what start
	// made; it never fails half-way silently: every error is returned.
	// keep: the sandbox is stopped, not removed (its files stay).
	teardown(sb *Sandbox, keep bool) []error
}

// Abilities a driver may have, found by type assertion.
type (
	// imageUpper: the sandbox's upper is always a disk image of its own
	// (its --disk, else one of the default bound's size), which its
	// instance mounts; the host never mounts it while the sandbox runs.
	imageUpper interface{ imageUpper() bool }
	// warmPauser: the sandboxes made ahead of need (primed, a pool's)
	// wait paused, the CPU an idle one spends (a guest's kernel's timers)
	// saved until it is taken.
	warmPauser interface{ pausesWarm() bool }
	// upperHolder makes a running sandbox's upper readable on the host,
	// consistent, until release (pack-diff reads it so).
	upperHolder interface {
		holdUpper(ctx context.Context, sb *Sandbox) (dir string, release func() error, err error)
	}
)

// startSpec is what the backend-neutral part of a start resolved.
type startSpec struct {
	// rootfs describes the sandbox's root, not mounted: the overlay of
	// its layers' mounts on the host (topmost first, nodev) under its
	// upper. A backend mounts it (idmapped into a user namespace, where
	// the sandbox has one) or hands its parts over.
	rootfs []mount.Mount
	// images are the layers' image files, topmost first, for a backend
	// that maps them itself (a lazy layer's: its fetcher's padded file).
	images   []string
	restrict *backend.Restrictions
	// readOnly and hidden are the policy's paths, the toolkit's among
	// the read-only ones unless the policy lets it be written.
	readOnly, hidden []string
}

// Backends are the backends this runtime runs, the default first: the
// one registry (package backend) a worker serves from.
var Backends = backend.NewRegistry(containerDriver{}, microvmDriver{})

// driverOf finds the driver of a sandbox's backend ("" is the default: a
// sandbox an older dsec made records none).
func driverOf(name string) (driver, error) {
	b, err := Backends.Lookup(name)
	if err != nil {
		return nil, err
	}
	return b.(driver), nil
}

// killInstance kills every process of the sandbox (its instance, then
// its group), removes its group and gives back its subnet: the part of a
// teardown every backend's is.
func (sb *Sandbox) killInstance() []error {
	var errs []error
	if sb.c != nil {
		sb.c.Destroy()
		sb.c = nil
	}
	if sb.g == nil {
		sb.g, _ = cgroup.Open(sb.CgroupName)
	}
	if sb.g != nil {
		if err := sb.g.Kill(); err != nil {
			errs = append(errs, err)
		}
	}
	// Its DNS and web ports redirected as long as a process of it may
	// send.
	if err := sb.stopDNS(); err != nil {
		errs = append(errs, err)
	}
	if sb.g != nil {
		if err := policy.ReleaseNetwork(sb.g.Path(), sb.Allowlist); err != nil {
			errs = append(errs, err)
		}
		if err := sb.g.Remove(); err != nil {
			errs = append(errs, err)
		}
		sb.g = nil
	}
	// Only a sandbox that asked for them holds a subnet or an id range:
	// both are asked for before its first state is saved, so a worker
	// killed between taking one and saving it still finds the ask.
	if sb.NAT != nil || sb.Policy == nil || sb.Policy.Network.Mode == api.NetworkNAT {
		if err := network.Down(sb.owner()); err != nil {
			errs = append(errs, err)
		}
		sb.NAT = nil
	}
	return errs
}

// ability is what sb's running instance can do of A, or a not
// implemented error that says what its backend cannot.
func ability[A any](sb *Sandbox, what string) (A, error) {
	a, ok := sb.c.(A)
	if !ok {
		return a, fmt.Errorf("the %s backend cannot %s in a running sandbox: %w", cmp.Or(sb.Backend, Backends.Names()[0]), what, errdefs.ErrNotImplemented)
	}
	return a, nil
}

// containerDriver runs the container backend's sandboxes: an init of
// package container as pid 1 of new namespaces, on an overlay of the
// host's layer mounts, in a cgroup of its own.
type containerDriver struct{ container.Backend }

// newID takes a spare init for a latency-class sandbox outside a user
// namespace: the spare's group is named by an ID made with it, which the
// sandbox then has (a cgroup2 group cannot be renamed). A sandbox
// started again after a stop makes a group of its own under its ID.
func (containerDriver) newID(sb *Sandbox, m Mounter) string {
	if sb.Limits.Idle || sb.UserNS {
		return newID()
	}
	sp := m.Spares.take()
	if sp == nil {
		return newID()
	}
	sb.prestarted = sp
	return sp.id
}

func (containerDriver) start(ctx context.Context, sb *Sandbox, m Mounter, s startSpec) error {
	rootfs := filepath.Join(sb.dir, "rootfs")
	// A spare init sits in its group already: the sandbox takes both. A
	// user namespace's init is started first, for its root's layers are
	// idmapped into its namespace.
	var sp *spare
	var own *container.Spare               // a user namespace's init
	devices := func() error { return nil } // a new group's v1 device lines, written meanwhile
	claimed := false
	defer func() {
		devices() // never left writing to a group teardown removes
		if !claimed && sp != nil {
			sp.init.Discard() // its group is the sandbox's now: teardown's
		}
		if !claimed && own != nil {
			own.Discard()
		}
	}()
	if sb.UserNS {
		ids, err := idmap.Take(sb.owner())
		if err != nil {
			return err
		}
		sb.IDs = ids
		if sb.g, devices, err = newGroup(sb.CgroupName, sb.Limits); err != nil {
			return err
		}
		if own, err = container.Prestart(sb.g.Add, ids); err != nil {
			return err
		}
		ns, err := own.UserNamespace()
		if err != nil {
			return err
		}
		for _, m := range s.rootfs {
			if err := m.MountIDMapped(rootfs, ns, ids.Host); err != nil {
				unix.Close(ns)
				return err
			}
		}
		unix.Close(ns)
	} else {
		for _, m := range s.rootfs {
			if n := len(strings.Join(m.Options, ",")); n >= os.Getpagesize() {
				return fmt.Errorf("%d layers are too many to stack (overlay's options would take %d bytes): fold the snapshot chain with dsec snap squash: %w", len(sb.Layers), n, errdefs.ErrOutOfRange)
			}
			if err := m.Mount(rootfs); err != nil {
				return err
			}
		}
		sp, _ = sb.prestarted.(*spare)
		sb.prestarted = nil
		if sp != nil { // its group is named by sb.ID
			sb.g = sp.g
			if err := sp.g.SetLimits(withInit(sb.Limits)); err != nil {
				return err
			}
		} else {
			g, d, err := newGroup(sb.CgroupName, sb.Limits)
			if err != nil {
				return err
			}
			sb.g, devices = g, d
		}
	}
	// The egress allowlist holds before anything in the sandbox runs: a
	// spare init in the group is dsec's own code, waiting.
	if err := policy.ApplyNetwork(sb.g.Path(), nil, sb.Allowlist); err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(sb.dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	spec := container.Spec{Root: rootfs, Hostname: sb.Hostname, Socket: filepath.Join(sb.dir, "init.sock"),
		Restrictions: s.restrict, Setup: sb.g.Add, Stderr: logf, Idle: sb.Limits.Idle, MergeMemory: sb.MergeMemory}
	var c *container.Conn
	switch {
	case sp != nil:
		claimed = true
		c, err = sp.init.Claim(spec)
	case own != nil:
		claimed = true
		c, err = own.Claim(spec)
	default:
		c, err = container.Create(spec)
	}
	if err != nil {
		return err
	}
	sb.c, sb.Pid = c, c.Pid()
	// Before the first command: the toolkit and the policy's read-only
	// and hidden paths.
	if _, err := c.Protect(s.readOnly, s.hidden); err != nil {
		return fmt.Errorf("policy files: %w", err)
	}
	if sb.Policy.Network.Mode == api.NetworkNAT {
		if sb.NAT, err = network.Up(sb.owner(), sb.Pid); err != nil {
			return err
		}
	}
	if err := devices(); err != nil {
		return fmt.Errorf("device allowlist: %w", err)
	}
	return nil
}

func (containerDriver) attach(sb *Sandbox) error {
	sb.g, _ = cgroup.Open(sb.CgroupName)
	if sb.g != nil && sb.g.Frozen() && !sb.Paused { // a worker died packing it
		sb.g.Thaw()
	}
	// A sandbox an older dsec made gets the device allowlist now (one
	// that has it keeps its own).
	if sb.g != nil {
		if err := policy.ApplyDevices(sb.g.Path()); err != nil {
			return err
		}
	}
	// A paused sandbox's init is frozen and cannot greet: it is
	// attached when it resumes.
	if sb.Paused {
		return nil
	}
	if c, err := container.Attach(filepath.Join(sb.dir, "init.sock"), sb.Pid); err == nil {
		sb.c = c
	}
	return nil
}

func (containerDriver) teardown(sb *Sandbox, _ bool) []error {
	errs := sb.killInstance()
	if sb.UserNS || sb.IDs != nil {
		if err := idmap.Give(sb.owner()); err != nil {
			errs = append(errs, err)
		}
		sb.IDs = nil
	}
	if err := mount.Unmount(filepath.Join(sb.dir, "rootfs")); err != nil && !mount.IsNotMounted(err) {
		errs = append(errs, err)
	}
	return errs
}
