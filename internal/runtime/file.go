package runtime

import "os"

// WriteFileAtomic replaces path with b: a reader sees the old bytes or
// the new, never part of them.
func WriteFileAtomic(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
