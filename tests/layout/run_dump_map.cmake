# Runs `dte plan --dump-map` for one topology pair, then check_dump_map.py on the CSV.
execute_process(COMMAND ${DTE} plan --model ${MODEL} --train ${TRAIN} --infer ${INFER}
                        --dump-map ${REF}/map.csv
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "dte plan --dump-map failed (${rc})")
endif()
set(hf_flag "")
if(INFER STREQUAL "hf")
  set(hf_flag "--hf")
endif()
execute_process(COMMAND ${PYTHON} ${SCRIPT} --reference ${REF} --map ${REF}/map.csv ${hf_flag}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "check_dump_map.py found mismatches (${rc})")
endif()
