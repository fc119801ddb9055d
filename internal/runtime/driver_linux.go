package runtime

import (
	"context"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime/driver"
	"github.com/dsec-project/dsec/internal/runtime/network"
)

// The runtime's side of the backend seam (package driver). A Sandbox
// does what every kind of sandbox needs: its layers found and held, its
// upper's storage, its state, its policy compiled, the journal of its
// steps, its group's limits and figures, its egress. Its driver does the
// rest, what only its backend does: start the sandbox's instance, find
// it again after a worker restart, and take down what it made.

// handle is what sb's driver is given of it.
func (sb *Sandbox) handle() driver.Handle {
	return driver.Handle{ID: sb.ID, Name: sb.Name, Dir: sb.dir, Root: sb.root(), Slot: sb.slot(), Groups: sb.host.Groups(), Group: sb.CgroupName,
		Pid: sb.Pid, Paused: sb.Paused, UserNS: sb.UserNS, Instance: sb.c,
		Record: driver.Record{IDs: sb.IDs, NAT: sb.NAT, VM: sb.VM, Machine: sb.Machine}}
}

// took keeps what a driver's start or attach made.
func (sb *Sandbox) took(s driver.Started) {
	sb.c = s.Instance
	if s.Group != nil {
		sb.g = s.Group
	}
	if s.Pid != 0 {
		sb.Pid = s.Pid
	}
	if s.IDs != nil {
		sb.IDs = s.IDs
	}
	if s.NAT != nil {
		sb.NAT = s.NAT
	}
	if s.VM != nil {
		sb.VM, sb.Machine = s.VM, s.Machine
	}
}

// attach finds sb's running instance again (sb.c nil: it died while no
// worker was there).
func (sb *Sandbox) attach(ctx context.Context) error {
	s, err := sb.d.Attach(ctx, sb.handle())
	sb.took(s)
	sb.g = s.Group // none found: none
	return err
}

// teardownInstance kills every process of the sandbox and takes down
// what its start made; keep: the sandbox is stopped, not removed (a
// guest's writes reach its disk before it goes).
func (sb *Sandbox) teardownInstance(keep bool) []error {
	if f, ok := sb.c.(driver.FSFreezer); ok && keep {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		f.FreezeFS(ctx)
		cancel()
	}
	h := sb.handle()
	errs := sb.killInstance()
	errs = append(errs, sb.d.Teardown(context.Background(), h)...)
	sb.IDs = nil
	return errs
}

// newID is the ID of sb, a sandbox about to be made: a warm instance's
// its driver made ahead for it (kept in sb.prestarted for start), or a
// new one.
func (sb *Sandbox) newID() string {
	if p, ok := sb.d.(driver.Prestarter); ok {
		if id, warm, ok := p.Prestart(driver.Prestart{Idle: sb.Limits.Idle, UserNS: sb.UserNS}); ok {
			sb.prestarted = warm
			return id
		}
	}
	return newID()
}

// dropPrestarted discards the warm instance newID took, if start did
// not take it.
func (sb *Sandbox) dropPrestarted() {
	if sb.prestarted != nil {
		sb.prestarted.Discard()
	}
	sb.prestarted = nil
}

// backendName is the name of sb's backend.
func (sb *Sandbox) backendName() string {
	if sb.d == nil {
		return sb.Backend
	}
	return sb.d.Name()
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
		sb.g, _ = sb.host.Groups().Open(sb.CgroupName)
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
		if err := network.Down(sb.slot()); err != nil {
			errs = append(errs, err)
		}
		sb.NAT = nil
	}
	return errs
}
