//go:build unix

package durable

import (
	"os"
	"syscall"
)

// Lock takes an flock on the file p (made if missing), exclusive or
// shared, and returns its release; the kernel drops it if the process
// dies.
func Lock(p string, exclusive bool) (release func(), err error) {
	f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o644) // it holds nothing
	if err != nil {
		return nil, err
	}
	how := syscall.LOCK_SH
	if exclusive {
		how = syscall.LOCK_EX
	}
	for {
		err = syscall.Flock(int(f.Fd()), how)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}
