//go:build linux

package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// journalAttempts are what an agent did to the exec journal while a
// command's stdout and stderr were the journal's files themselves,
// handed to it: /proc/self/fd/1 named a host path; the file grew past
// any disk quota (fallocate, ftruncate, a write far past its end, on
// the host's file system); and a process the step left rewrote the
// step's output after it ended (pwrite, an O_TRUNC open of
// /proc/self/fd/1), so that a replay returned forged output. A command
// gets pipes that a process out of its reach (the init, non-dumpable:
// its descriptors neither open nor read) copies into the journal, bounded
// and closed when the step ends: every attempt fails. Outside, with its
// output a file, each goes through.
func journalAttempts(initPid int) []attempt {
	stdoutSize := func(fd int) (int64, error) {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return 0, err
		}
		return st.Size, nil
	}
	return []attempt{
		{"stdout a file", func() error {
			var st unix.Stat_t
			if err := unix.Fstat(1, &st); err != nil {
				return err
			}
			if st.Mode&unix.S_IFMT != unix.S_IFREG {
				return errors.New("not a file")
			}
			return nil
		}},
		{"stdout a host path", func() error {
			l, err := os.Readlink("/proc/self/fd/1")
			if err != nil {
				return err
			}
			if strings.HasPrefix(l, "pipe:") {
				return errors.New("pipe")
			}
			return nil
		}},
		// Allocation kept past the file's size: what a quota would
		// charge, shown by no size (1 MiB here; the agent took 256).
		{"fallocate stdout", func() error { return unix.Fallocate(1, unix.FALLOC_FL_KEEP_SIZE, 0, 1<<20) }},
		{"ftruncate stdout", func() error {
			n, err := stdoutSize(1)
			if err != nil {
				return err
			}
			return unix.Ftruncate(1, n) // its size: nothing printed is lost
		}},
		{"pwrite stdout", func() error { _, err := unix.Pwrite(1, nil, 0); return err }},
		{"truncate stdout by its /proc link", func() error {
			fd, err := unix.Open("/proc/self/fd/1", unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			n, err := stdoutSize(fd)
			if err != nil {
				return err
			}
			return unix.Ftruncate(fd, n)
		}},
		// The numbers of its descriptors list (the sandbox's root owns
		// a non-dumpable process's /proc entries); what they are does
		// not read.
		{"init's fd links", func() error {
			dir := fmt.Sprintf("/proc/%d/fd", initPid)
			ents, err := os.ReadDir(dir)
			if err != nil {
				return err
			}
			err = errors.New("no descriptors")
			for _, e := range ents {
				if _, err = os.Readlink(dir + "/" + e.Name()); err == nil {
					return nil
				}
			}
			var pe *os.PathError
			if errors.As(err, &pe) {
				return pe.Err
			}
			return err
		}},
	}
}
