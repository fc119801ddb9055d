package container

import (
	"github.com/dsec-project/dsec/internal/runtime/backend"
	"github.com/dsec-project/dsec/internal/runtime/initproto"
)

// Conn is the worker's connection to a container's init: what every
// init answers (initproto.Conn), and what a container's host side does
// in its namespaces (Protect, SetHostname, Terminal).
type Conn struct{ *initproto.Conn }

// ErrSandboxDied says the sandbox's init is gone (or the connection to
// it): an infrastructure failure, not the command's.
var ErrSandboxDied = backend.ErrDied

// A Conn is the container backend's Instance.
var (
	_ backend.Instance   = (*Conn)(nil)
	_ backend.Restricter = (*Conn)(nil)
	_ backend.Protecter  = (*Conn)(nil)
	_ backend.Renamer    = (*Conn)(nil)
	_ backend.Signaler   = (*Conn)(nil)
	_ backend.Terminaler = (*Conn)(nil)
)

// Attach connects to the init of a running sandbox by its socket (the
// worker's restart), pid its process.
func Attach(socket string, pid int) (*Conn, error) {
	c, err := initproto.Attach(socket, pid)
	if err != nil {
		return nil, err
	}
	return &Conn{c}, nil
}
