package worker

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLockRoot: a lock held for a dead worker (by a descriptor it left
// in a child) is waited for; one held by a live worker is refused at once.
func TestLockRoot(t *testing.T) {
	root := t.TempDir()
	path := filepath.Join(root, "worker.lock")
	open := func() *os.File {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	held := open()
	if err := unix.Flock(int(held.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	writePid := func(pid int) {
		if err := os.WriteFile(filepath.Join(root, "worker.pid"), []byte(strconv.Itoa(pid)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	writePid(os.Getpid()) // alive: refused at once
	start := time.Now()
	if err := lockRoot(open(), root); !errors.Is(err, ErrRootServed) || time.Since(start) > time.Second {
		t.Fatalf("a live worker's lock: %v after %v", err, time.Since(start))
	}

	writePid(dead.Process.Pid) // dead: its lock goes in 200 ms
	time.AfterFunc(200*time.Millisecond, func() { held.Close() })
	start = time.Now()
	if err := lockRoot(open(), root); err != nil || time.Since(start) < 150*time.Millisecond {
		t.Fatalf("a dead worker's lock: %v after %v", err, time.Since(start))
	}
}
