// Package durable writes files so that a crash of the process or of the
// host leaves either the old contents or the new, never part of them and
// never neither: a temporary file in the same file system, written,
// fsynced and closed, renamed over the target, and the directory
// fsynced so that the rename itself survives. It is the recipe the
// layer store uses for its index, kept here for every file whose loss
// would change what dsec does: a sandbox's state, the pools, the
// tokens. (An exec's result is a line of its sandbox's results log,
// synced with fdatasync: package journal.)
package durable

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// trace, when set (tests), is told each step of the recipe.
var trace func(step string)

func note(step string) {
	if trace != nil {
		trace(step)
	}
}

// WriteFile replaces path with b, mode perm, durably.
func WriteFile(path string, b []byte, perm os.FileMode) error {
	return WriteFileIn(filepath.Dir(path), path, b, perm)
}

// Replace replaces path with b atomically but without waiting for the
// disk: a reader sees the old bytes or the new, and a crash may leave
// the old (or, on some file systems, an empty file). Only for a file
// whose loss changes nothing (a sandbox's state while it is being made:
// a sandbox without one is removed as if it never was) or whose bytes
// are also kept durably elsewhere (an exec's result.json, its results
// log's line), where two fsyncs would cost every create or exec.
func Replace(path string, b []byte, perm os.FileMode) error {
	return write(filepath.Dir(path), path, b, perm, false)
}

// WriteFileIn is WriteFile with its temporary file in tmpDir, which must
// be on path's file system (the store keeps them in its ingest
// directory, where an interrupted write is swept).
func WriteFileIn(tmpDir, path string, b []byte, perm os.FileMode) error {
	return write(tmpDir, path, b, perm, true)
}

func write(tmpDir, path string, b []byte, perm os.FileMode, sync bool) (err error) {
	f, err := os.CreateTemp(tmpDir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	note("create")
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if _, err := f.Write(b); err != nil {
		return err
	}
	note("write")
	if sync {
		if err := f.Sync(); err != nil {
			return err
		}
		note("fsync")
	}
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	note("close")
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	note("rename")
	if !sync {
		return nil
	}
	if err := SyncDir(filepath.Dir(path)); err != nil {
		return fmt.Errorf("%s is written, but its directory could not be synced: %w", path, err)
	}
	note("fsync dir")
	return nil
}

// SyncDir fsyncs a directory: what was renamed, made or removed in it
// survives a crash.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, os.ErrInvalid) {
		return err
	}
	return nil
}
