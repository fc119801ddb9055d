package runtime

import (
	"cmp"
	"errors"
	"fmt"
	"io"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/cgroup"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/driver/containers"
	"github.com/dsec-project/dsec/internal/runtime/driver/microvms"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// The backends a worker runs, each driver built with its configuration
// here and nowhere else: a new backend is a package implementing
// driver.Driver and its line below.

// DriverConfig configures the drivers.
type DriverConfig struct {
	// Root is the worker's root.
	Root string
	// Spares are the container inits kept started ahead of need (0:
	// none).
	Spares int
	// MicroVM configures the microvm backend, VM the vm backend.
	MicroVM microvm.Settings
	VM      vms.Settings
	// Extra are drivers beyond the built-in ones (a test's).
	Extra []driver.Driver
	// DNS configures the egress service of sandboxes with domain
	// rules (nil: none, and such sandboxes fail to start).
	DNS *egress.Config
	// Groups is the tree of the sandboxes' groups (nil: under
	// cgroup.DefaultParent).
	Groups *cgroup.Tree
}

// NewDrivers builds the drivers c configures, the default first;
// Prepare starts what they keep ahead of need, Close stops it.
func NewDrivers(c DriverConfig) *Drivers {
	groups := c.Groups
	if groups == nil {
		groups = cgroup.NewTree("")
	}
	list := []driver.Driver{
		containers.New(containers.Config{Root: c.Root, Spares: c.Spares, Groups: groups}),
		microvms.New(c.MicroVM),
		vms.New(c.VM),
	}
	list = append(list, c.Extra...)
	bs := make([]backend.Backend, len(list))
	for i, d := range list {
		bs[i] = d
	}
	ds := &Drivers{Registry: backend.NewRegistry(bs...), list: list, groups: groups}
	if c.DNS != nil {
		ds.egress = network.NewEgress(*c.DNS)
	}
	return ds
}

// Drivers are the drivers a worker runs: a registry (package backend)
// whose backends are drivers.
type Drivers struct {
	*backend.Registry
	list   []driver.Driver
	egress *network.Egress
	groups *cgroup.Tree
}

// Groups is the tree of the groups ds's sandboxes run in.
func (ds *Drivers) Groups() *cgroup.Tree { return ds.groups }

// Egress is the egress service of the sandboxes of ds (nil: none).
func (ds *Drivers) Egress() *network.Egress {
	if ds == nil {
		return nil
	}
	return ds.egress
}

// Driver finds the driver named name ("" is the default: a sandbox an
// older dsec made records none).
func (ds *Drivers) Driver(name string) (driver.Driver, error) {
	b, err := ds.Lookup(name)
	if err != nil {
		return nil, err
	}
	return b.(driver.Driver), nil
}

// Default is the default backend's name.
func (ds *Drivers) Default() string { return ds.Names()[0] }

// MemoryBackend names the backend whose sandboxes continue a memory
// snapshot's guest ("": none here).
func (ds *Drivers) MemoryBackend() string {
	for _, d := range ds.list {
		if _, ok := d.(driver.MemorySnapshotter); ok {
			return d.Name()
		}
	}
	return ""
}

// BaseBackend names the backend whose sandboxes boot a base of its own
// kind, a VM image, rather than a stack of layers ("": none here).
func (ds *Drivers) BaseBackend() string {
	for _, d := range ds.list {
		if _, ok := d.(driver.BaseResolver); ok {
			return d.Name()
		}
	}
	return ""
}

// BootsBase says whether the backend named name ("" the default) boots
// a base of its own kind (driver.BaseResolver): its one layer ref names
// a VM image, not a layer.
func (ds *Drivers) BootsBase(name string) bool {
	d, err := ds.Driver(name)
	if err != nil {
		return false
	}
	_, ok := d.(driver.BaseResolver)
	return ok
}

// Prepare starts what the drivers keep ahead of need (spare inits).
// Nil-safe.
func (ds *Drivers) Prepare() {
	if ds == nil {
		return
	}
	for _, d := range ds.list {
		if p, ok := d.(interface{ Prepare() }); ok {
			p.Prepare()
		}
	}
}

// Ready counts the instances the drivers keep made ahead of need and
// ready (spare inits). Nil-safe.
func (ds *Drivers) Ready() int {
	if ds == nil {
		return 0
	}
	n := 0
	for _, d := range ds.list {
		if w, ok := d.(interface{ Ready() int }); ok {
			n += w.Ready()
		}
	}
	return n
}

// Close stops what the drivers keep ahead of need, and lets go of the
// egress service's queue. Nil-safe.
func (ds *Drivers) Close() error {
	if ds == nil {
		return nil
	}
	var errs []error
	for _, d := range ds.list {
		if c, ok := d.(io.Closer); ok {
			errs = append(errs, c.Close())
		}
	}
	if ds.egress != nil {
		errs = append(errs, ds.egress.Close())
	}
	return errors.Join(errs...)
}

// MicroVMHost is what this host runs microVMs with (an error says what
// it lacks), as ds's microvm driver resolved it.
func (ds *Drivers) MicroVMHost() (*microvm.Host, error) {
	d, err := ds.Driver(microvms.MicroVM)
	if err != nil {
		return nil, err
	}
	h, ok := d.(interface{ Host() (*microvm.Host, error) })
	if !ok {
		return nil, fmt.Errorf("backend %s resolves no host: %w", d.Name(), errdefs.ErrNotImplemented)
	}
	return h.Host()
}

// ability is what sb's running instance can do of A, or a not
// implemented error that says what its backend cannot.
func ability[A any](sb *Sandbox, what string) (A, error) {
	a, ok := sb.c.(A)
	if !ok {
		return a, fmt.Errorf("the %s backend cannot %s in a running sandbox: %w", cmp.Or(sb.Backend, sb.backendName()), what, errdefs.ErrNotImplemented)
	}
	return a, nil
}
