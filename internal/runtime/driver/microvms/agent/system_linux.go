package agent

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/runtime/container"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// A full VM's agent: the same agent as a microVM's, as a service of the
// guest's own init (systemd, which the image's units have start it once
// the system is up), not its pid 1. The guest booted its own kernel
// from its own disk: the agent mounts nothing and moves nowhere; it sets
// the clock, entropy, host name and network the host gives, holds the
// policy's paths, and serves commands as root of the guest (whose kernel
// is its own: no capability is dropped).

// setupSystem makes the running guest the sandbox spec describes.
func setupSystem(s *initproto.GuestSpec) (*guest, error) {
	setClock(s)
	if s.Hostname != "" {
		if err := unix.Sethostname([]byte(s.Hostname)); err != nil {
			return nil, fmt.Errorf("sethostname: %w", err)
		}
	}
	if s.Net != nil {
		if err := guestNet(s.Net); err != nil {
			return nil, err
		}
	}
	g := &guest{}
	var err error
	// The root's file system is what a snapshot freezes.
	if g.upper, err = unix.Open("/", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	if _, err := container.ProtectPaths(os.Getpid(), s.ReadOnly, s.Hidden); err != nil {
		return nil, fmt.Errorf("policy files: %w", err)
	}
	return g, nil
}
