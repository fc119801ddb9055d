// Package containers is the container backend's driver: a sandbox is an
// init of package container as pid 1 of new namespaces, on an overlay of
// the host's layer mounts, in a cgroup of its own; inits are started
// ahead of need (Spares) for the sandboxes that can take one.
package containers

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/idmap"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// Config configures the driver.
type Config struct {
	// Root is the worker's root; Spares the inits kept started ahead
	// of need for its sandboxes (0: none, every sandbox starts its own).
	Root   string
	Spares int
	// Groups is the tree of the sandboxes' groups (nil: under
	// cgroup.DefaultParent).
	Groups *cgroup.Tree
}

// Driver runs the container backend's sandboxes.
type Driver struct {
	container.Backend
	c      Config
	spares *Spares
}

var (
	_ driver.Driver       = (*Driver)(nil)
	_ driver.Prestarter   = (*Driver)(nil)
	_ driver.FileOpener   = (*Driver)(nil)
	_ driver.SocketCloser = (*Driver)(nil)
)

// New makes the driver.
func New(c Config) *Driver { return &Driver{c: c} }

// Prepare starts making the spare inits its Config asks for, until
// Close (once the worker swept what a dead one left).
func (d *Driver) Prepare() {
	if d.c.Spares > 0 && d.spares == nil {
		d.spares = StartSpares(d.c.Groups, d.c.Root, d.c.Spares)
	}
}

// Close stops making spares and kills those waiting.
func (d *Driver) Close() error {
	d.spares.Close()
	return nil
}

// Ready counts the spare inits waiting to be taken.
func (d *Driver) Ready() int { return d.spares.Ready() }

// Prestart takes a spare init for a latency-class sandbox outside a
// user namespace: the spare's group is named by an ID made with it,
// which the sandbox then has (a cgroup2 group cannot be renamed). A
// sandbox started again after a stop makes a group of its own under its
// ID.
func (d *Driver) Prestart(p driver.Prestart) (string, driver.Warm, bool) {
	if p.Idle || p.UserNS {
		return "", nil, false
	}
	sp := d.spares.take()
	if sp == nil {
		return "", nil, false
	}
	return sp.id, sp, true
}

// Start mounts the sandbox's root, puts its init in its group (a
// spare's, or a new one) and hands the init its root.
func (d *Driver) Start(ctx context.Context, s driver.StartSpec) (out driver.Started, err error) {
	rootfs := filepath.Join(s.Dir, "rootfs")
	// A spare init sits in its group already: the sandbox takes both. A
	// user namespace's init is started first, for its root's layers are
	// idmapped into its namespace.
	sp, _ := s.Warm.(*spare)
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
	if s.UserNS {
		ids, err := idmap.Take(s.Slot)
		if err != nil {
			return out, err
		}
		out.IDs = ids
		g, d, err := driver.NewGroup(s.Groups, s.Group, s.Limits)
		if err != nil {
			return out, err
		}
		out.Group, devices = g, d
		if own, err = container.Prestart(driver.Adder(g, d), ids); err != nil {
			return out, err
		}
		if err := mountIDMapped(s.RootFS, rootfs, own, ids.Host); err != nil {
			return out, err
		}
	} else {
		if err := mountRoot(s.RootFS, rootfs); err != nil {
			return out, err
		}
		if sp != nil { // its group is named by the sandbox's ID
			out.Group = sp.g
			if err := sp.g.SetLimits(driver.WithInit(s.Limits)); err != nil {
				return out, err
			}
		} else {
			g, d, err := driver.NewGroup(s.Groups, s.Group, s.Limits)
			if err != nil {
				return out, err
			}
			out.Group, devices = g, d
		}
	}
	// The egress allowlist holds before anything in the sandbox runs: a
	// spare init in the group is dsec's own code, waiting.
	if err := policy.ApplyNetwork(out.Group.Path(), nil, s.Allowlist); err != nil {
		return out, err
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, "init.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return out, err
	}
	defer logf.Close()
	spec := container.Spec{Root: rootfs, Hostname: s.Hostname, Socket: filepath.Join(s.Dir, "init.sock"),
		Restrictions: s.Restrict, Setup: driver.Adder(out.Group, devices), Stderr: logf, Idle: s.Limits.Idle, MergeMemory: s.MergeMemory}
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
		return out, fmt.Errorf("%w%s", err, container.LastWords(logf.Name()))
	}
	out.Instance, out.Pid = c, c.Pid()
	// Before the first command: the toolkit and the policy's read-only
	// and hidden paths.
	if _, err := c.Protect(s.ReadOnly, s.Hidden); err != nil {
		return out, fmt.Errorf("policy files: %w", err)
	}
	if s.NAT {
		if out.NAT, err = network.Up(s.Slot, out.Pid); err != nil {
			return out, err
		}
	}
	if err := devices(); err != nil {
		return out, fmt.Errorf("device allowlist: %w", err)
	}
	return out, nil
}

// mountIDMapped mounts the sandbox's root, layers, at rootfs, idmapped
// into the user namespace of own, its init, whose root is the host's id
// host.
func mountIDMapped(layers []mount.Mount, rootfs string, own *container.Spare, host uint32) error {
	ns, err := own.UserNamespace()
	if err != nil {
		return err
	}
	for _, m := range layers {
		if err := m.MountIDMapped(rootfs, ns, host); err != nil {
			unix.Close(ns)
			return err
		}
	}
	unix.Close(ns)
	return nil
}

// mountRoot mounts the sandbox's root, layers, at rootfs.
func mountRoot(layers []mount.Mount, rootfs string) error {
	for _, m := range layers {
		if err := m.Mount(rootfs); errdefs.IsOutOfRange(err) {
			return fmt.Errorf("%w: fold the snapshot chain with dsec snap squash", err)
		} else if err != nil {
			return err
		}
	}
	return nil
}

// Attach finds the sandbox's group and, unless it is paused, its init.
func (d *Driver) Attach(_ context.Context, h driver.Handle) (out driver.Started, err error) {
	out.Group, _ = h.Groups.Open(h.Group)
	if out.Group != nil && out.Group.Frozen() && !h.Paused { // a worker died packing it
		out.Group.Thaw()
	}
	// A sandbox an older dsec made gets the device allowlist now (one
	// that has it keeps its own).
	if out.Group != nil {
		if err := policy.ApplyDevices(out.Group.Path()); err != nil {
			return out, err
		}
	}
	// A paused sandbox's init is frozen and cannot greet: it is
	// attached when it resumes.
	if h.Paused {
		return out, nil
	}
	if c, err := container.Attach(filepath.Join(h.Dir, "init.sock"), h.Pid); err == nil {
		out.Instance, out.Pid = c, h.Pid
	}
	return out, nil
}

// Teardown gives back the sandbox's ids and unmounts its root.
func (d *Driver) Teardown(_ context.Context, h driver.Handle) []error {
	var errs []error
	if h.UserNS || h.IDs != nil {
		if err := idmap.Give(h.Slot); err != nil {
			errs = append(errs, err)
		}
	}
	if err := mount.Unmount(filepath.Join(h.Dir, "rootfs")); err != nil && !mount.IsNotMounted(err) {
		errs = append(errs, err)
	}
	return errs
}

// CloseSockets destroys the sandbox's established TCP sockets that closed
// answers true for, in its network namespace (SOCK_DESTROY).
func (d *Driver) CloseSockets(h driver.Handle, closed func(src, dst netip.AddrPort, proto uint8) bool) (int, error) {
	return network.DestroySockets(h.Pid, closed)
}

// Files opens a running sandbox's files from the host, through its root.
func (d *Driver) Files(h driver.Handle) (backend.Files, error) {
	return openHostFiles(filepath.Join(h.Dir, "rootfs"), h.IDs)
}
