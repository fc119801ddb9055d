package main

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// docsDate is the date printed in generated man pages. It is fixed so
// that regenerating the pages changes them only when the commands do.
var docsDate = time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)

// docsCommand writes man pages and shell completions from the command
// tree; `make docs` runs it and `make test` fails when its output differs
// from what is committed.
func (a *app) docsCommand() *cobra.Command {
	return &cobra.Command{
		Use:    "gen-docs DIR",
		Short:  "Write man pages to DIR/man and completions to DIR/completions",
		Hidden: true,
		Args:   exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			root := cmd.Root()
			root.DisableAutoGenTag = true
			// Defaults that depend on who runs this would make the pages
			// differ between machines: describe them instead.
			pf := root.PersistentFlags()
			pf.Lookup("root").DefValue = "/var/lib/dsec as root, $XDG_DATA_HOME/dsec otherwise"
			man := filepath.Join(args[0], "man", "man1")
			comp := filepath.Join(args[0], "completions")
			for _, d := range []string{man, comp} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					return err
				}
			}
			hdr := &doc.GenManHeader{Title: "DSEC", Section: "1", Source: "dsec", Manual: "dsec manual", Date: &docsDate}
			if err := doc.GenManTree(root, hdr, man); err != nil {
				return fmt.Errorf("man pages: %w", err)
			}
			gens := map[string]func(string) error{
				"dsec.bash": func(p string) error { return root.GenBashCompletionFileV2(p, true) },
				"dsec.zsh":  root.GenZshCompletionFile,
				"dsec.fish": func(p string) error { return root.GenFishCompletionFile(p, true) },
			}
			for name, gen := range gens {
				if err := gen(filepath.Join(comp, name)); err != nil {
					return fmt.Errorf("completion %s: %w", name, err)
				}
			}
			return nil
		},
	}
}
